// A library that exports cuInit and nothing else of the driver API: what the CUDA backend
// must refuse as "not a usable CUDA driver" (tests only).
extern "C" int cuInit(unsigned int) { return 0; }
