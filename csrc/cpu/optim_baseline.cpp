// The baseline path of the CPU optimizer step (optim_clone.inc).
#define MPF_CPU_CLONE 0
#define MPF_CPU_CLONE_NS baseline
#include "optim_clone.inc"
