#pragma once
// Host shims that let kernels.cu compile as plain C++ (clang++ -DRLP_HOST_EMULATION), so that
// its index arithmetic, block sampling and region search are tested on machines without a GPU
// (worker/tests/kernels_emulated.rs): the test runs every thread of every thread block one
// after another. Warp shuffles are replaced (flush adds each thread's sum directly).
#include <stdint.h>
static unsigned rlp_tid, rlp_ctaid_x, rlp_nctaid_x, rlp_ctaid_y, rlp_nctaid_y;
#define __nvvm_read_ptx_sreg_tid_x() rlp_tid
#define __nvvm_read_ptx_sreg_ctaid_x() rlp_ctaid_x
#define __nvvm_read_ptx_sreg_nctaid_x() rlp_nctaid_x
#define __nvvm_read_ptx_sreg_ctaid_y() rlp_ctaid_y
#define __nvvm_read_ptx_sreg_nctaid_y() rlp_nctaid_y
#define __attribute__(x)
