//! CUDA and NCCL through cudarc, loaded at run time.
