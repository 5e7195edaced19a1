// The avx512 path of the CPU optimizer step (optim_clone.inc).
#define MPF_CPU_CLONE 2
#define MPF_CPU_CLONE_NS avx512
#include "optim_clone.inc"
