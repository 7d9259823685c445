//! Transports that carry refit buckets: TCP (CPU), NCCL and CUDA IPC (GPU).
