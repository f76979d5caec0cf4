// tent-rs: upstream's MultiTransport header, so that includes resolve. The engine chooses its
// transports itself; MultiTransport is only declared.
#ifndef TENT_RS_MOONCAKE_MULTI_TRANSPORT_H
#define TENT_RS_MOONCAKE_MULTI_TRANSPORT_H

#include <unordered_map>

#include "transport/transport.h"

namespace mooncake {
class MultiTransport;
}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_MULTI_TRANSPORT_H
