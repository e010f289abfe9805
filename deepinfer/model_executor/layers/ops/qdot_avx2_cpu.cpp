// The AVX2 and AVX-VNNI variants of qdot_cpu.cpp's integer dot products: that file's body compiled
// for the 256-bit instruction sets, as a unit of its own, so that the build compiles it beside the
// AVX-512 variant (in one unit the three took ~155 s of a ~155 s build on two cores).

#define DEEPINFER_QDOT_256 1
#include "qdot_cpu.cpp"
