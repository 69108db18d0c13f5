// python/csrc/binding.h: an op's schema arguments onto one C++ struct, by name, written once.
//
// An op's file declares its argument struct (one member per schema argument, named as the argument) and a Binding:
// the op's name and, in schema order, PCPKV_ARG(Struct, member) for each argument. From that one list come
//   kernel<B, run>()  the function registered for a dispatch key: its parameters are the schema's (torch checks their
//                     types against registry.cpp's schema), it fills the struct by name and calls run(const Struct&);
//   typed_op(B) / call(op, args)  another op's call with a filled struct (the vLLM drop-in calls pcpkv::dispatch);
// and, on the first use of either, a check that the names are the registered schema's, in order. Adding an argument
// is its schema text in registry.cpp and one member with its PCPKV_ARG line.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pcpkv_torch {

/// One schema argument: the struct member that takes it (Member) and its name in the schema.
template <auto Member>
struct Arg {
  static constexpr auto member = Member;
  const char* name;
};
#define PCPKV_ARG(Struct, member) ::pcpkv_torch::Arg<&Struct::member> { #member }

/// An op ("ns::name") and its arguments in schema order.
template <class... A>
struct Binding {
  const char* op;
  std::tuple<A...> args;
  constexpr explicit Binding(const char* o, A... a) : op(o), args(a...) {}
};

namespace binding_detail {

template <class M>
struct MemberOf;
template <class S, class T>
struct MemberOf<T S::*> {
  using Struct = S;
  using Type = T;
};

// What the dispatcher passes for a member of type T (the schema type torch infers from it).
template <class T>
struct Param {
  using type = T;  // bool, int64_t, double: by value
};
template <>
struct Param<at::Tensor> {
  using type = const at::Tensor&;
};
template <>
struct Param<std::optional<at::Tensor>> {
  using type = const std::optional<at::Tensor>&;
};
template <>
struct Param<std::vector<at::Tensor>> {
  using type = at::TensorList;
};
template <>
struct Param<std::string> {
  using type = c10::string_view;
};

template <class T>
T own(typename Param<T>::type v) {
  if constexpr (std::is_same_v<T, std::string>) return std::string(v);
  else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) return v.vec();
  else return v;
}

template <class B, size_t I>
using ArgAt = std::tuple_element_t<I, decltype(B::args)>;
template <class B, size_t I>
using TypeAt = typename MemberOf<std::remove_cv_t<decltype(ArgAt<B, I>::member)>>::Type;
template <class B>
using StructOf = typename MemberOf<std::remove_cv_t<decltype(ArgAt<B, 0>::member)>>::Struct;
template <class B>
using Indices = std::make_index_sequence<std::tuple_size_v<decltype(B::args)>>;

// The names against the registered schema's: an internal error (a Binding out of step with registry.cpp).
template <class B, size_t... I>
bool check_names(const B& b, std::index_sequence<I...>) {
  const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(b.op, "").schema();
  const std::vector<std::string> names = {std::get<I>(b.args).name...};
  std::vector<std::string> want;
  for (const auto& a : schema.arguments()) want.push_back(a.name());
  TORCH_CHECK(names == want, "pcpkv_torch internal error: the Binding of ", b.op, " names ", c10::Join(", ", names),
              " but its schema (csrc/registry.cpp) ", c10::Join(", ", want));
  return true;
}

template <const auto& B, auto Run, class Seq = Indices<std::remove_cvref_t<decltype(B)>>>
struct Kernel;
template <const auto& B, auto Run, size_t... I>
struct Kernel<B, Run, std::index_sequence<I...>> {
  using BT = std::remove_cvref_t<decltype(B)>;
  static void fn(typename Param<TypeAt<BT, I>>::type... v) {
    static const bool names_checked = check_names(B, Indices<BT>{});
    (void)names_checked;
    StructOf<BT> a;
    ((a.*ArgAt<BT, I>::member = own<TypeAt<BT, I>>(v)), ...);
    Run(a);
  }
};

template <class BT, class Seq = Indices<BT>>
struct Signature;
template <class BT, size_t... I>
struct Signature<BT, std::index_sequence<I...>> {
  using type = void(typename Param<TypeAt<BT, I>>::type...);
};

}  // namespace binding_detail

/// The kernel of op B for one dispatch key: m.impl("name", kernel<kBinding, &run>()).
template <const auto& B, auto Run>
constexpr auto kernel() {
  return &binding_detail::Kernel<B, Run>::fn;
}

/// The C++ signature of op B's kernels (void(parameters in schema order)).
template <class BT>
using SignatureOf = typename binding_detail::Signature<std::remove_cvref_t<BT>>::type;

/// The dispatcher's typed handle of op B (its names checked against the schema once).
template <class BT>
c10::TypedOperatorHandle<SignatureOf<BT>> typed_op(const BT& b) {
  binding_detail::check_names(b, binding_detail::Indices<BT>{});
  return c10::Dispatcher::singleton().findSchemaOrThrow(b.op, "").template typed<SignatureOf<BT>>();
}

/// Calls op B through the dispatcher (the kernel of the arguments' device) with the members of `a`.
template <class BT, class S, size_t... I>
void call(const c10::TypedOperatorHandle<SignatureOf<BT>>& op, const BT&, const S& a, std::index_sequence<I...>) {
  op.call(a.*binding_detail::ArgAt<BT, I>::member...);
}
template <class BT, class S>
void call(const c10::TypedOperatorHandle<SignatureOf<BT>>& op, const BT& b, const S& a) {
  call(op, b, a, binding_detail::Indices<BT>{});
}

}  // namespace pcpkv_torch
