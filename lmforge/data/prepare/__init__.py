"""The `data prepare` job and its kin: raw sources → work units → executors (local, Slurm, Ray) → packed MDS shards; `data dedup` (``dedup``) and `data stats` (``stats``)."""
