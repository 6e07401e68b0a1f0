// What a user's own build compiles: the host API under the user's compiler and flags.
// scripts/check-user-build compiles it with g++ and clang++, -Wall -Wextra -Werror, at the
// compilers' default -march and at x86-64-v3: the project's own -march hides ABI warnings
// (-Wpsabi) that a plain build sees. The engines, the module wrapper and the optimizer are
// classes, not templates, so every member is checked here, used or not.
#include <shardkit/shardkit.hpp>
// The image readers, outside shardkit.hpp (they need libjpeg's and libpng's headers).
#if __has_include(<jpeglib.h>) && __has_include(<png.h>)
#include <shardkit/data/image_folder.hpp>
#endif

namespace sk = shardkit;

int main() {
  sk::Context ctx({.seed = 1});
  auto t = sk::zeros(ctx, {4}, sk::DType::f32);
  return t.numel() == 4 ? 0 : 1;
}
