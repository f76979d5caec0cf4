// tent-rs: upstream's UB (UnifiedBus) allocator header, so that includes resolve. tent-rs has
// no UB transport; these are used only in builds with USE_UB, which tent-rs does not support.
#pragma once

#include <cstddef>

#ifdef USE_UB
#error "tent-rs has no UB transport: build without USE_UB"
#endif

namespace mooncake {}  // namespace mooncake
