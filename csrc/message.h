// Error messages built without iostreams, and ATTNKIT_CHECK, the check macro every native source
// uses instead of TORCH_CHECK.
//
// Why (issue 10, measured on an H100 image: torch 2.11.0+cu130, g++ 13, nvcc 13.0): every failing
// TORCH_CHECK in attnkit._C killed the process, in the C++ (CPU) sources as in the CUDA ones.  The
// backtrace ends in `std::ostream::_M_insert<long>` resolved *inside* attnkit/_C.so, called from
// c10::str formatting the message: in that build the stream-insertion code attnkit's objects bind
// to is not the one libstdc++ initialised (its locale facets), and the first integer written
// into a message segfaults.  torch's own errors (formatted inside libc10 / libtorch) were fine.
// So attnkit formats its messages itself -- std::string appends and std::to_string, nothing that
// touches a std::locale -- and hands the finished string to c10's torchCheckFail, which builds
// and throws the c10::Error inside libc10 as torch's own checks do.  Messages read as before.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace attnkit {
namespace message {

inline void put(std::string& s, const char* x) { s += x; }
inline void put(std::string& s, const std::string& x) { s += x; }
inline void put(std::string& s, std::string_view x) { s.append(x.data(), x.size()); }
inline void put(std::string& s, char x) { s += x; }
inline void put(std::string& s, bool x) { s += x ? "true" : "false"; }

template <typename T,
          std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
inline void put(std::string& s, T x) {
  s += std::to_string(x);
}

template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline void put(std::string& s, T x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
  s += buf;
}

inline void put(std::string& s, c10::ScalarType x) { s += c10::toString(x); }
inline void put(std::string& s, const c10::Device& x) { s += x.str(); }  // formatted inside libc10
inline void put(std::string& s, c10::DeviceType x) { s += c10::DeviceTypeName(x, /*lower_case=*/true); }

// Shapes print as torch prints them: [2, 3, 4].
template <typename T>
inline void put(std::string& s, c10::ArrayRef<T> xs) {
  s += '[';
  for (size_t i = 0; i < xs.size(); ++i) {
    if (i) s += ", ";
    put(s, xs[i]);
  }
  s += ']';
}
template <typename T>
inline void put(std::string& s, const std::vector<T>& xs) {
  put(s, c10::ArrayRef<T>(xs));
}

// The message of a failed check: its pieces appended in order.
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (put(s, args), ...);
  return s;
}

}  // namespace message
}  // namespace attnkit

// ATTNKIT_CHECK(cond, pieces...): like TORCH_CHECK (raises c10::Error, a RuntimeError in Python),
// with the message assembled by attnkit::message::cat only when the check fails.
#define ATTNKIT_CHECK(cond, ...)                                                                   \
  do {                                                                                             \
    if (C10_UNLIKELY(!(cond))) {                                                                   \
      ::c10::detail::torchCheckFail(__func__, __FILE__, static_cast<uint32_t>(__LINE__),           \
                                    ::attnkit::message::cat(__VA_ARGS__));                         \
    }                                                                                              \
  } while (false)
