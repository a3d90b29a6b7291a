// The dense tensors of a zero-copy load, made in one C++ loop over the table's packed columns.
//
// Each tensor is made by at::from_blob over its bytes in the mapping: its own storage of exactly
// its extent (as torch.from_numpy of a slice gives it), whose deleter holds the mapping's
// storage, so the mapping outlives every tensor made over it. Python's path
// (ckptcache/codec/table/tensors.py) does the same with a numpy slice and torch.from_numpy per
// tensor, where making the Python objects of the slices costs as much as the tensors.
//
// The caller has checked the columns (codes, storage indices, alignment, bounds); every place
// and size is checked again here all the same, so that no column can make a tensor reach past
// the mapping: a ValueError, not a tensor.

#include <torch/extension.h>
#include <torch/headeronly/version.h>

#include "_walk.h"

#include <cstdint>
#include <limits>
#include <vector>

namespace {

void check_column(const at::Tensor& column, at::ScalarType type, const char* name) {
  TORCH_CHECK_VALUE(column.device().is_cpu() && column.dim() == 1 && column.is_contiguous() &&
                        column.scalar_type() == type,
                    "column ", name, " is not a one-dimensional contiguous CPU array of ", type);
}

// The tensors over ``whole`` (uint8, the mapping): the i-th of dtype kinds[code[i]], shape the
// next ndim[i] entries of ``dims``, starting at byte starts[i], covering exactly sizes[i] bytes.
std::vector<at::Tensor> over_mapping(const at::Tensor& whole, const at::Tensor& starts,
                                     const at::Tensor& sizes, const at::Tensor& dims,
                                     const at::Tensor& ndim, const at::Tensor& code,
                                     const std::vector<at::Tensor>& kinds) {
  TORCH_CHECK_VALUE(whole.device().is_cpu() && whole.dim() == 1 && whole.is_contiguous() &&
                        whole.scalar_type() == at::kByte,
                    "the mapping is not a one-dimensional contiguous uint8 CPU tensor");
  check_column(starts, at::kLong, "starts");
  check_column(sizes, at::kLong, "sizes");
  check_column(dims, at::kLong, "dims");
  check_column(ndim, at::kByte, "ndim");
  check_column(code, at::kByte, "code");
  const int64_t n = starts.numel();
  TORCH_CHECK_VALUE(sizes.numel() == n && ndim.numel() == n && code.numel() == n,
                    "columns of unequal lengths");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* size = sizes.data_ptr<int64_t>();
  const int64_t* dim = dims.data_ptr<int64_t>();
  const uint8_t* nd = ndim.data_ptr<uint8_t>();
  const uint8_t* kind = code.data_ptr<uint8_t>();
  const int64_t n_dims = dims.numel();
  const int64_t limit = whole.numel();
  char* base = static_cast<char*>(whole.data_ptr());
  std::vector<at::TensorOptions> options;
  std::vector<int64_t> itemsize;
  for (const at::Tensor& k : kinds) {
    options.push_back(at::TensorOptions().dtype(k.scalar_type()).device(at::kCPU));
    itemsize.push_back(static_cast<int64_t>(k.element_size()));
  }
  // Copied into every deleter: the last tensor made over the mapping releases it.
  const c10::Storage owner = whole.storage();
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  std::vector<int64_t> shape;
  int64_t d = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(kind[i] < kinds.size(), "dtype code ", int(kind[i]), " off the list");
    TORCH_CHECK_VALUE(nd[i] <= n_dims - d, "more dims named than the column holds");
    const int64_t item = itemsize[kind[i]];
    shape.assign(dim + d, dim + d + nd[i]);
    d += nd[i];
    int64_t numel = 1;
    for (int64_t extent : shape) {
      // Each extent within the mapping's size: a product that passes it stops the loop first.
      TORCH_CHECK_VALUE(extent >= 0 && extent <= limit, "a dim out of range");
      numel *= extent;
      TORCH_CHECK_VALUE(numel <= limit, "a shape larger than the mapping");
    }
    TORCH_CHECK_VALUE(item > 0 && numel * item == size[i], "a shape that is not its storage's size");
    TORCH_CHECK_VALUE(start[i] >= 0 && start[i] % item == 0 && size[i] <= limit - start[i],
                      "a storage off the mapping or off its dtype's alignment");
    out.push_back(at::from_blob(base + start[i], shape, [owner](void*) {}, options[kind[i]]));
  }
  TORCH_CHECK_VALUE(d == n_dims, "dims left over");
  return out;
}

}  // namespace

PYBIND11_MODULE(_tensors, m) {
  m.doc() = "The dense tensors of a zero-copy load, made in one C++ loop; the walk of a save.";
  // The torch this was compiled against: another torch's tensor structures may differ, so the
  // Python side uses the loop only under the same version.
  m.attr("torch_version") =
      py::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  m.def("over_mapping", &over_mapping,
        "Tensors over a uint8 mapping from packed columns (starts, sizes, dims, ndim, code) "
        "and one tensor of each dtype code (kinds).");
  register_walk(m);
}
