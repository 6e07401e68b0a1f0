// CallsDiffer: the ranks met in one call but had issued different ones (another kind, count,
// dtype, root, op or label). The meeting refuses it on every rank alike, and every rank's call
// is used up by it, so the ranks are still in step: the communicator stays usable
// (Communicator::in_step lets this error pass without marking the ranks out of step).
#pragma once

#include "shardkit/core/error.hpp"

namespace shardkit::comm {

class CallsDiffer : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

}  // namespace shardkit::comm
