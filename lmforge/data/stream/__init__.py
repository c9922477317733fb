"""The training stream: which prepared data a run reads (``run_data``) and each rank's deterministic, resumable tokens (``tokens``)."""
