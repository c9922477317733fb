"""Evaluation task definitions and their data, read without torch: LLM Foundry's ICL task files
(`tasks.icl`). Evaluation (`eval`) scores them; curation (`data.curate.decontaminate`) removes
training documents that contain them. Both read them here, so neither depends on the other.
"""
