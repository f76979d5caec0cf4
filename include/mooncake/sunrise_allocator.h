// tent-rs: upstream's Sunrise device allocator header, so that an unconditional include in a CPU
// build resolves. It declares nothing: tent-rs has no Sunrise transport, and a build with
// USE_SUNRISE fails here, with the reason, instead of at link or run time.
#ifndef TENT_RS_MOONCAKE_SUNRISE_ALLOCATOR_H
#define TENT_RS_MOONCAKE_SUNRISE_ALLOCATOR_H

#if defined(USE_SUNRISE)
#error "tent-rs's classic C++ class has no Sunrise transport: build without USE_SUNRISE"
#endif

#endif  // TENT_RS_MOONCAKE_SUNRISE_ALLOCATOR_H
