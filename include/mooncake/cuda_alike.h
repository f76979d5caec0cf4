// tent-rs: upstream's GPU vendor switch, so that includes resolve in CPU builds. tent-rs's
// classic class has no GPU transports: a build with a GPU vendor selected fails here, with
// the reason, instead of at link or run time.
#ifndef TENT_RS_MOONCAKE_CUDA_ALIKE_H
#define TENT_RS_MOONCAKE_CUDA_ALIKE_H

#if defined(USE_CUDA) || defined(USE_MUSA) || defined(USE_HIP) || defined(USE_MLU) || defined(USE_MACA) || \
    defined(USE_SUPA) || defined(USE_SUNRISE) || defined(USE_HYGON) || defined(USE_COREX) || defined(USE_UBSHMEM)
#error "tent-rs's classic C++ class has no GPU transports: build without USE_CUDA and the other GPU vendor options"
#endif

#include <string>
const static std::string GPU_PREFIX = "cuda:";

#endif  // TENT_RS_MOONCAKE_CUDA_ALIKE_H
