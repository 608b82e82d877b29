// gRPC metadata keys of the normgrad API that the server sends and the client reads: one
// definition, so that the two sides cannot drift apart.
#pragma once

namespace normgrad::v1 {

// The trailing metadata key of every RmsNormBackward status the server itself sends: by then no
// job of the stream reads or writes the client's memory, and none will (docs/api.md, "The end of
// a call"). A status without it (one gRPC made up: a cut-off cancel, a lost connection) says
// nothing of the kind.
inline constexpr char kWritesDoneTrailer[] = "normgrad-writes-done";

}  // namespace normgrad::v1
