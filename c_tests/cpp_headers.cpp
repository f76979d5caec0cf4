// Every public C++ header of both classes in one translation unit, each named directly: the
// classic tree (include/mooncake/, put on the include path as Store does) and the TENT class
// (include/tent/). tests/cpp_headers.rs compiles it as C++20 with warnings as errors and runs it.
#include "transfer_engine.h"
#include "transport/transport.h"
#include "transfer_metadata.h"
#include "transfer_metadata_plugin.h"
#include "common.h"
#include "config.h"
#include "error.h"
#include "memory_location.h"
#include "common/base/status.h"
#include "topology.h"
#include "multi_transport.h"
#include "ub_allocator.h"
#include "cuda_alike.h"
#include "sunrise_allocator.h"

#include "tent/transfer_engine.h"
#include "tent/transfer_engine_cxx.h"
#include "tent/common/status.h"
#include "tent/common/types.h"
#include "tent/common/config.h"

#include <cstdio>

int main() {
    // A few names from each, so that the headers are used and not only parsed.
    mooncake::Status classic = mooncake::Status::InvalidArgument("classic");
    mooncake::tent::Status tent = mooncake::tent::Status::InvalidArgument("tent");
    mooncake::TransferRequest req{.opcode = mooncake::TransferRequest::WRITE,
                                  .source = nullptr,
                                  .target_id = 0,
                                  .target_offset = 0,
                                  .length = 0};
    mooncake::tent::Request treq{.opcode = mooncake::tent::Request::WRITE,
                                 .source = nullptr,
                                 .target_id = 0,
                                 .target_offset = 0,
                                 .length = 0};
    const bool ok = !classic.ok() && classic.IsInvalidArgument() && !tent.ok() && tent.IsInvalidArgument() &&
                    req.opcode == mooncake::TransferRequest::WRITE && treq.priority == mooncake::tent::PRIO_HIGH &&
                    mooncake::kWildcardLocation == "*" && ERR_INVALID_ARGUMENT < 0;
    std::printf("cpp_headers: %d passed, %d failed\n", ok ? 1 : 0, ok ? 0 : 1);
    return ok ? 0 : 1;
}
