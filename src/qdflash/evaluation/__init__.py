"""Quality evaluation: an lm-eval model for qdflash targets (`lm`), local tasks over the offline
evaluation items (`tasks`), and the gate arithmetic (`gates`)."""
