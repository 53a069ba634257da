"""One thin Hydra entry point per DAG node: `python -m qdflash.stages.<node> key=value ...`."""
