// The CUDA simulator stands in for the toolkit header of this name (see ../sim.h).
#pragma once
#include "../sim.h"
