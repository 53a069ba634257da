# Sourced by the GPU scripts: where things live on the H200 machine (outside the checkout, so they
# survive from one call to the next while the machine stays warm).
export QDFLASH_GPU_ROOT=${QDFLASH_GPU_ROOT:-/root/qdflash}
export QDFLASH_STAGE=$QDFLASH_GPU_ROOT/stage          # pieces, bundle, READY marker
export QDFLASH_SITE=$QDFLASH_GPU_ROOT/site            # wheels installed with --target
export QDFLASH_DATA_DIR=$QDFLASH_STAGE/bundle/data    # prompt sources (qdflash.data.sources)
export QDFLASH_CACHE_DIR=$QDFLASH_GPU_ROOT/cache      # converted GGUF
export QDFLASH_RESULTS=$QDFLASH_GPU_ROOT/results      # Snakemake results_dir
export PYTHONPATH=$PWD/src:$QDFLASH_SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$QDFLASH_SITE/bin:$PATH
export HF_HUB_OFFLINE=1 WANDB_MODE=${WANDB_MODE:-offline} PYTHONUNBUFFERED=1
