// A non-owning reference to a callable, without its type (C++26's std::function_ref, cut to
// what shardkit needs): a pointer to the callable and a pointer to a function that calls it.
//
// Why: code that takes a callable as a template parameter is compiled once per callable. Where
// that code is large and the call is not hot -- the thread pool's locking, OpenMP region and
// exception handling around every host loop; the config reader's catch clauses around each of
// its readers -- taking a FunctionRef lets it be compiled once, for one indirect call. Unlike
// std::function it never allocates and never copies the callable.
//
// A FunctionRef refers to its callable, which must outlive it: take it as a parameter, call it
// before returning, and never store it.
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace shardkit::detail {

template <class Signature>
class FunctionRef;

// A callable object, invocable as R(Args...), that a FunctionRef<R(Args...)> can refer to (not a
// FunctionRef: a copy of one refers to its object, not to it).
template <class F, class R, class... Args>
concept FunctionRefTarget =
    !std::is_same_v<std::remove_cvref_t<F>, FunctionRef<R(Args...)>> &&
    std::is_object_v<std::remove_reference_t<F>> && std::is_invocable_r_v<R, F&, Args...>;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <FunctionRefTarget<R, Args...> F>
  FunctionRef(F&& f) noexcept  // NOLINT(google-explicit-constructor): binds like a reference
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, Args... args) -> R {
          auto& f = *static_cast<std::remove_reference_t<F>*>(object);
          if constexpr (std::is_void_v<R>)
            std::invoke(f, std::forward<Args>(args)...);  // (a result, if any, is dropped)
          else
            return std::invoke(f, std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace shardkit::detail
