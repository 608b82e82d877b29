// Links normgrad::client from an install tree and makes one call to a port where nothing
// listens: exit 0 when that call fails with UNAVAILABLE, as it must.
#include <cstdio>
#include <memory>
#include <vector>

#include "normgrad/client.h"

int main(int argc, char** argv) {
  normgrad::ClientOptions options;
  options.target = argc > 1 ? argv[1] : "127.0.0.1:1";
  options.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<normgrad::Client>> client = normgrad::Client::Create(options);
  if (!client.ok()) {
    std::fprintf(stderr, "Create: %s\n", client.status().ToString().c_str());
    return 1;
  }
  const std::vector<float> x(8, 1.0f), gamma(4, 1.0f);
  absl::StatusOr<normgrad::Gradients> g = (*client)->Backward(x, x, gamma, 1e-5f);
  std::printf("Backward: %s\n", g.status().ToString().c_str());
  return g.status().code() == absl::StatusCode::kUnavailable ? 0 : 1;
}
