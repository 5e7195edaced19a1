// The avx2 path of the CPU optimizer step (optim_clone.inc).
#define MPF_CPU_CLONE 1
#define MPF_CPU_CLONE_NS avx2
#include "optim_clone.inc"
