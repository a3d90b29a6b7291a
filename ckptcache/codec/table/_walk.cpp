// The walk of a save's object for its plan key (ckptcache/codec/plan/cache.py's describe), in
// one C++ call: the containers walked by the C API, each tensor's fields read from torch's own
// structures.
//
// One walker emits the key's tokens to one of two sinks. The reference sink makes the key
// exactly as describe() makes it (a tuple of Python objects), so that tests, and the plan cache
// on each miss, can compare the two walks token for token. The compact sink writes the same
// tokens as bytes, each one self-delimiting (a tag, then a fixed-size or length-prefixed
// payload), so that two byte keys are equal exactly when the reference keys are; comparing
// them is one memcmp where comparing the tuples was a Python comparison per token.
//
// What the walk does not describe (any object but the common containers, scalars and plain
// dense CPU/CUDA tensors; a tensor describe() refuses; nesting deeper than kMaxDepth) ends it
// with None: the caller then walks in Python, which decides. The GIL is held throughout and
// no Python code runs, so nothing the walk reads changes under it.

#include "_walk.h"

#include <c10/core/CPUAllocator.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

namespace py = pybind11;

// Deeper nesting is left to the Python walk (which fails at its recursion limit where a
// pickler would too).
constexpr int kMaxDepth = 400;

// Thrown where the walk does not describe the object: the caller walks in Python.
struct NotHandled {};

// The kinds of the key's tokens, as describe() adds the value's type.
enum Kind : uint8_t {
  kDict = 'd', kOrderedDict = 'o', kList = 'l', kTuple = 't', kStr = 's', kBytes = 'b',
  kInt = 'i', kBool = '?', kNone = 'n', kFloat = 'f', kTensor = 'T', kRef = 'R',
};

// What a walk needs from Python, made once per process: the classes compared by identity,
// the reference key's marker and the dtypes describe() refuses.
struct Policy {
  py::object tensor_class, ordered_dict, ref_marker;
  std::vector<bool> refused;  // by ScalarType
  Policy(py::object tensor, py::object odict, py::object ref, const py::list& refused_dtypes)
      : tensor_class(std::move(tensor)), ordered_dict(std::move(odict)),
        ref_marker(std::move(ref)), refused(256, false) {
    for (py::handle d : refused_dtypes) {
      TORCH_CHECK_TYPE(THPDtype_Check(d.ptr()), "refused dtypes must be torch dtypes");
      refused[static_cast<size_t>(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type)] = true;
    }
  }
};

// Object address -> value, open addressing: the walk's memo and storage index (a std map's
// node per entry cost more than the rest of a tensor's work).
class AddressMap {
 public:
  explicit AddressMap(size_t expected) { grow(expected * 2 + 16); }
  // The value at ``key``, or -1 after inserting ``value`` there.
  int64_t find_or_insert(const void* key, int64_t value) {
    if ((used_ + 1) * 2 > keys_.size()) grow(keys_.size() * 2);
    size_t i = slot(key);
    while (keys_[i] != nullptr) {
      if (keys_[i] == key) return values_[i];
      i = (i + 1) & (keys_.size() - 1);
    }
    keys_[i] = key;
    values_[i] = value;
    ++used_;
    return -1;
  }

 private:
  size_t slot(const void* key) const {
    auto h = reinterpret_cast<uintptr_t>(key) * UINT64_C(0x9E3779B97F4A7C15);
    return static_cast<size_t>(h >> 17) & (keys_.size() - 1);
  }
  void grow(size_t at_least) {
    size_t n = 16;
    while (n < at_least) n <<= 1;
    std::vector<const void*> old_keys(n, nullptr);
    std::vector<int64_t> old_values(n, 0);
    old_keys.swap(keys_);
    old_values.swap(values_);
    used_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != nullptr) find_or_insert(old_keys[i], old_values[i]);
    }
  }
  std::vector<const void*> keys_;
  std::vector<int64_t> values_;
  size_t used_ = 0;
};

// A new reference, or the pending Python error raised.
py::object owned(PyObject* obj) {
  if (obj == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(obj);
}

// The compact key: bytes. Integers as varints (LEB128; zigzag where they may be negative), so
// that every token is self-delimiting and the key is short to make and to compare.
class BytesSink {
 public:
  // Buffers per thread, kept between walks: a key of megabytes regrown from empty would take
  // fresh pages from the kernel (and their faults) on every save.
  explicit BytesSink(const Policy&) : out_(buffer(0)), rows_(buffer(1)) {
    out_.clear();
    rows_.clear();
  }
  size_t position() const { return out_.size(); }
  void kind(Kind k) { out_.push_back(static_cast<char>(k)); }
  void length(size_t n) { unsigned_(out_, n); }
  void ref(size_t at) {
    kind(kRef);
    unsigned_(out_, at);
  }
  void str(PyObject* s) {
    // Canonical (PEP 393: the narrowest kind that holds it): equal strings, equal bytes.
    const auto n = static_cast<size_t>(PyUnicode_GET_LENGTH(s));
    const auto unit = static_cast<size_t>(PyUnicode_KIND(s));
    out_.push_back(static_cast<char>(unit));
    unsigned_(out_, n);
    out_.append(static_cast<const char*>(PyUnicode_DATA(s)), n * unit);
  }
  void bytes(PyObject* b) {
    const auto n = static_cast<size_t>(PyBytes_GET_SIZE(b));
    unsigned_(out_, n);
    out_.append(PyBytes_AS_STRING(b), n);
  }
  void width(int w) { out_.push_back(static_cast<char>(w)); }
  void wide_int(PyObject*, int64_t v) { signed_(out_, v); }
  void boolean(bool v) { out_.push_back(v ? 1 : 0); }
  void none() {}  // implied by its kind
  void float_bits(uint64_t bits) { out_.append(reinterpret_cast<const char*>(&bits), 8); }
  // describe()'s eight columns, a row per tensor (kept apart: they follow the walk's tokens),
  // then the storages' sizes.
  void column_row(at::ScalarType dtype, at::IntArrayRef shape, at::IntArrayRef strides,
                  int64_t offset, int64_t index, bool grad, int64_t device) {
    rows_.push_back(static_cast<char>(dtype));
    unsigned_(rows_, shape.size());
    for (int64_t v : shape) signed_(rows_, v);
    for (int64_t v : strides) signed_(rows_, v);
    signed_(rows_, offset);
    unsigned_(rows_, static_cast<uint64_t>(index));
    rows_.push_back(grad ? 1 : 0);
    signed_(rows_, device);
  }
  void columns_end(const std::vector<int64_t>& storage_sizes) {
    out_.append(rows_);
    unsigned_(out_, storage_sizes.size());
    for (int64_t v : storage_sizes) unsigned_(out_, static_cast<uint64_t>(v));
  }
  py::object key() { return py::bytes(out_); }
  py::object columns() { return py::none(); }

 private:
  static void unsigned_(std::string& to, uint64_t v) {
    char bytes[10];
    size_t n = 0;
    while (v >= 0x80) {
      bytes[n++] = static_cast<char>((v & 0x7f) | 0x80);
      v >>= 7;
    }
    bytes[n++] = static_cast<char>(v);
    to.append(bytes, n);
  }
  static void signed_(std::string& to, int64_t v) {
    unsigned_(to, (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63));
  }
  static std::string& buffer(int which) {
    static thread_local std::string kept[2];
    return kept[which];
  }
  std::string& out_;
  std::string& rows_;
};

// The reference key: describe()'s tuple, token for token (and its columns).
class TupleSink {
 public:
  explicit TupleSink(const Policy& p) : p_(p), key_(owned(PyList_New(0))) {
    for (auto& c : columns_) c = owned(PyList_New(0));
  }
  size_t position() const { return static_cast<size_t>(PyList_GET_SIZE(key_.ptr())); }
  void kind(Kind k) {
    PyObject* type = nullptr;
    switch (k) {
      case kDict: type = reinterpret_cast<PyObject*>(&PyDict_Type); break;
      case kOrderedDict: type = p_.ordered_dict.ptr(); break;
      case kList: type = reinterpret_cast<PyObject*>(&PyList_Type); break;
      case kTuple: type = reinterpret_cast<PyObject*>(&PyTuple_Type); break;
      case kStr: type = reinterpret_cast<PyObject*>(&PyUnicode_Type); break;
      case kBytes: type = reinterpret_cast<PyObject*>(&PyBytes_Type); break;
      case kInt: type = reinterpret_cast<PyObject*>(&PyLong_Type); break;
      case kBool: type = reinterpret_cast<PyObject*>(&PyBool_Type); break;
      case kNone: type = reinterpret_cast<PyObject*>(Py_TYPE(Py_None)); break;
      case kFloat: type = reinterpret_cast<PyObject*>(&PyFloat_Type); break;
      case kTensor: type = p_.tensor_class.ptr(); break;
      case kRef: type = p_.ref_marker.ptr(); break;
    }
    add(type);
  }
  void length(size_t n) { add_new(PyLong_FromSize_t(n)); }
  void ref(size_t at) { kind(kRef); length(at); }
  void str(PyObject* s) { add(s); }
  void bytes(PyObject* b) { add(b); }
  void width(int w) { add_new(PyLong_FromLong(w)); }
  void wide_int(PyObject* v, int64_t) { add(v); }
  void boolean(bool v) { add(v ? Py_True : Py_False); }
  void none() { add(Py_None); }
  void float_bits(uint64_t bits) {
    char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<char>((bits >> (8 * i)) & 0xff);
    add_new(PyBytes_FromStringAndSize(le, 8));
  }
  void column_row(at::ScalarType dtype, at::IntArrayRef shape, at::IntArrayRef strides,
                  int64_t offset, int64_t index, bool grad, int64_t device) {
    append(columns_[0], reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
    append(columns_[1], ints(shape).ptr());
    append(columns_[2], ints(strides).ptr());
    append(columns_[3], owned(PyLong_FromLongLong(offset)).ptr());
    append(columns_[4], owned(PyLong_FromLongLong(index)).ptr());
    append(columns_[5], grad ? Py_True : Py_False);
    append(columns_[6], owned(PyLong_FromLongLong(device)).ptr());
  }
  void columns_end(const std::vector<int64_t>& storage_sizes) {
    for (int64_t n : storage_sizes) append(columns_[7], owned(PyLong_FromLongLong(n)).ptr());
    py::tuple all(8);
    for (size_t i = 0; i < 8; ++i) {
      all[i] = owned(PyList_AsTuple(columns_[i].ptr()));
      add(all[i].ptr());
    }
    columns_tuple_ = all;
  }
  py::object key() { return owned(PyList_AsTuple(key_.ptr())); }
  py::object columns() { return columns_tuple_; }

 private:
  static py::object ints(at::IntArrayRef values) {
    py::object t = owned(PyTuple_New(static_cast<Py_ssize_t>(values.size())));
    for (size_t i = 0; i < values.size(); ++i) {
      PyTuple_SET_ITEM(t.ptr(), i, owned(PyLong_FromLongLong(values[i])).release().ptr());
    }
    return t;
  }
  static void append(const py::object& list, PyObject* item) {
    if (PyList_Append(list.ptr(), item) != 0) throw py::error_already_set();
  }
  void add(PyObject* item) { append(key_, item); }
  void add_new(PyObject* item) { add(owned(item).ptr()); }
  const Policy& p_;
  py::object key_;
  py::object columns_[8];
  py::object columns_tuple_ = py::none();
};

// What a walk found: the key, the tensors in pickling order, their storages in first-use
// order (held: they stay alive while this does), and the fields a save needs of them.
struct Walked {
  py::object key, tensors, ints, versions, storage_ids, columns;
  bool on_cpu = true;
  std::vector<c10::Storage> storages;
  std::vector<int64_t> addresses, sizes;

  // The storages' addresses and sizes as they are now (read again where the copy starts: a
  // storage resized since the walk has moved, and its old bytes may be gone).
  py::bytes addresses_now() const {
    std::vector<int64_t> now(storages.size());
    for (size_t i = 0; i < storages.size(); ++i) {
      now[i] = reinterpret_cast<int64_t>(storages[i].data());
    }
    return py::bytes(reinterpret_cast<const char*>(now.data()), now.size() * sizeof(int64_t));
  }
  py::bytes sizes_now() const {
    std::vector<int64_t> now(storages.size());
    for (size_t i = 0; i < storages.size(); ++i) {
      now[i] = static_cast<int64_t>(storages[i].nbytes());
    }
    return py::bytes(reinterpret_cast<const char*>(now.data()), now.size() * sizeof(int64_t));
  }
  void release() {
    std::vector<c10::Storage> gone;
    gone.swap(storages);
    // Dropping a storage reference waits on its line (long out of the caches): thousands of
    // them, outside the GIL.
    py::gil_scoped_release unlocked;
    gone.clear();
  }
  py::list storage_objects() const {
    py::list out(storages.size());
    for (size_t i = 0; i < storages.size(); ++i) out[i] = owned(THPStorage_Wrap(storages[i]));
    return out;
  }
};

template <class Sink>
class Walker {
 public:
  // ``keep_tensors``: give the tensors as a list (a non-blocking save's check needs them, a
  // blocking save does not: they are held by the caller's object throughout).
  Walker(const Policy& p, bool versions, bool keep_tensors)
      : p_(p), sink_(p), versions_(versions), seen_(64), keep_tensors_(keep_tensors),
        ints_(owned(PyList_New(0))) {}

  std::unique_ptr<Walked> run(PyObject* obj) {
    visit(obj, 0);
    auto out = std::make_unique<Walked>();
    columns(*out);
    out->key = sink_.key();
    out->columns = sink_.columns();
    out->tensors = keep_tensors_ ? tensor_list() : owned(PyList_New(0));
    out->ints = owned(PyList_AsTuple(ints_.ptr()));
    return out;
  }

 private:
  void visit(PyObject* v, int depth) {
    if (depth > kMaxDepth) throw NotHandled();
    PyTypeObject* type = Py_TYPE(v);
    if (type == &PyUnicode_Type) {
      sink_.kind(kStr);
      sink_.str(v);
    } else if (type == &PyLong_Type) {
      integer(v);
    } else if (type == &PyBool_Type) {
      sink_.kind(kBool);
      sink_.boolean(v == Py_True);
    } else if (v == Py_None) {
      sink_.kind(kNone);
      sink_.none();
    } else if (type == &PyFloat_Type) {
      // Its bits, as the pickler writes them: 0.0 and -0.0, and NaNs, differ.
      double d = PyFloat_AS_DOUBLE(v);
      uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      sink_.kind(kFloat);
      sink_.float_bits(bits);
    } else if (type == &PyBytes_Type) {
      sink_.kind(kBytes);
      sink_.bytes(v);
    } else if (type == &PyTuple_Type) {
      // Rebuilt equal by a load, not memoized by identity: no memo entry.
      const Py_ssize_t n = PyTuple_GET_SIZE(v);
      sink_.kind(kTuple);
      sink_.length(static_cast<size_t>(n));
      ++unmemoized_;
      for (Py_ssize_t i = 0; i < n; ++i) visit(PyTuple_GET_ITEM(v, i), depth + 1);
      --unmemoized_;
    } else if (type == &PyDict_Type || type == &PyList_Type ||
               reinterpret_cast<PyObject*>(type) == p_.ordered_dict.ptr() ||
               reinterpret_cast<PyObject*>(type) == p_.tensor_class.ptr()) {
      // Kept by identity through a pickle: a second reference is a memo lookup.
      if (memo(v)) return;
      if (reinterpret_cast<PyObject*>(type) == p_.tensor_class.ptr()) {
        sink_.kind(kTensor);
        add_tensor(v);
      } else if (type == &PyList_Type) {
        const Py_ssize_t n = PyList_GET_SIZE(v);
        sink_.kind(kList);
        sink_.length(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); ++i) visit(PyList_GET_ITEM(v, i), depth + 1);
      } else if (type == &PyDict_Type) {
        sink_.kind(kDict);
        dict_items(v, depth);
      } else {
        sink_.kind(kOrderedDict);
        ordered_items(v, depth);
        // Its attributes (state_dict()'s _metadata), pickled after the items: describe()
        // walks a copy, a dict no other reference reaches, so it is never a memo hit.
        PyObject** attrs = _PyObject_GetDictPtr(v);
        const Py_ssize_t n = (attrs != nullptr && *attrs != nullptr) ? PyDict_GET_SIZE(*attrs) : 0;
        sink_.length(static_cast<size_t>(n));
        if (n > 0) {
          sink_.kind(kDict);
          ++unmemoized_;
          dict_items(*attrs, depth);
          --unmemoized_;
        }
      }
    } else {
      throw NotHandled();  // reduced objects and subclasses: the Python walk's
    }
  }

  // Whether ``v`` was visited before (its reference emitted); else its first visit noted.
  bool memo(PyObject* v) {
    // Held by one reference alone (its container's), it is reached once: nothing to note.
    // Not so inside a tuple, or an OrderedDict's attributes, which the walk may pass twice
    // (neither is memoized).
    if (Py_REFCNT(v) == 1 && unmemoized_ == 0) return false;
    const int64_t first = seen_.find_or_insert(v, static_cast<int64_t>(sink_.position()));
    if (first < 0) return false;
    sink_.ref(static_cast<size_t>(first));
    return true;
  }

  void integer(PyObject* v) {
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow != 0) throw NotHandled();  // beyond 64 bits: the Python walk's
    if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
    sink_.kind(kInt);
    if (x >= INT32_MIN && x <= INT32_MAX) {
      // Its pickled width (BININT1/BININT2/BININT), its value in ``ints`` (patched in).
      sink_.width(x >= 0 && x < 256 ? 1 : x >= 0 && x < 65536 ? 2 : 4);
      if (PyList_Append(ints_.ptr(), v) != 0) throw py::error_already_set();
    } else {
      sink_.wide_int(v, static_cast<int64_t>(x));
    }
  }

  void item(PyObject* k, PyObject* v, int depth) {
    visit(k, depth + 1);
    visit(v, depth + 1);
  }

  void dict_items(PyObject* d, int depth) {
    const Py_ssize_t n = PyDict_GET_SIZE(d);
    sink_.length(static_cast<size_t>(n));
    // Cursors run ahead of the walk: the first fetches the values' objects; the second (by
    // then they have come) a dict's table of items; the third that dict's first values. A
    // walk of many small dicts then waits on their misses a few at a time, not one by one.
    Py_ssize_t pos = 0, ahead[3] = {0, 0, 0};
    PyObject *k = nullptr, *v = nullptr;
    if (n < kAheadFrom) {  // a few items: nothing to run ahead of
      while (PyDict_Next(d, &pos, &k, &v)) item(k, v, depth);
      return;
    }
    for (int c = 0; c < 3; ++c) {
      for (Py_ssize_t j = 0; j < kAhead[c] && PyDict_Next(d, &ahead[c], &k, &v); ++j) {
        fetch(c, v);
      }
    }
    while (PyDict_Next(d, &pos, &k, &v)) {
      for (int c = 0; c < 3; ++c) {
        PyObject *ak = nullptr, *av = nullptr;
        if (PyDict_Next(d, &ahead[c], &ak, &av)) fetch(c, av);
      }
      item(k, v, depth);
    }
  }

  // How many items ahead of the walk each cursor of dict_items() runs, in dicts of at least
  // kAheadFrom items.
  static constexpr Py_ssize_t kAhead[3] = {12, 8, 4};
  static constexpr Py_ssize_t kAheadFrom = 16;

  // What the walk reads next of a value: its object (stage 0); then, for a dict, its table of
  // items (1) and the objects of its first values (2).
  static void fetch(int stage, PyObject* v) {
    if (stage == 0) {
      __builtin_prefetch(v);
      return;
    }
    if (Py_TYPE(v) != &PyDict_Type) return;
    if (stage == 1) {
      const auto* dict = reinterpret_cast<PyDictObject*>(v);
      const char* table = reinterpret_cast<const char*>(dict->ma_keys);
      for (int line = 0; line < 4; ++line) __builtin_prefetch(table + 64 * line);
      return;
    }
    Py_ssize_t pos = 0;
    PyObject *k = nullptr, *item = nullptr;
    for (int j = 0; j < 4 && PyDict_Next(v, &pos, &k, &item); ++j) __builtin_prefetch(item);
  }

  void ordered_items(PyObject* d, int depth) {
    // In the OrderedDict's own order (its dict's may differ after move_to_end).
    sink_.length(static_cast<size_t>(PyDict_GET_SIZE(d)));
    py::object items = owned(PyObject_CallMethod(d, "items", nullptr));
    py::object it = owned(PyObject_GetIter(items.ptr()));
    while (PyObject* pair = PyIter_Next(it.ptr())) {
      py::object held = owned(pair);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) throw NotHandled();
      item(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), depth);
    }
    if (PyErr_Occurred()) throw py::error_already_set();
  }

  // Borrowed: the walk runs under the GIL, no Python code runs, and the caller's object holds
  // every tensor it reaches.
  void add_tensor(PyObject* v) { tensors_.push_back(v); }

  py::object tensor_list() const {
    py::object list = owned(PyList_New(static_cast<Py_ssize_t>(tensors_.size())));
    for (size_t i = 0; i < tensors_.size(); ++i) {
      PyList_SET_ITEM(list.ptr(), static_cast<Py_ssize_t>(i), Py_NewRef(tensors_[i]));
    }
    return list;
  }

  // describe()'s tensor_columns: the checks, the storages in first-use order, the columns, in
  // one pass over the tensors. Their structures are mostly out of the caches by now (a save
  // follows a training step), and one tensor's reads wait on each other: the tensors a few
  // places ahead are fetched meanwhile, so that their misses overlap.
  void columns(Walked& out) {
    const auto n = static_cast<Py_ssize_t>(tensors_.size());
    PyObject* const* items = tensors_.data();
    AddressMap index_of(64);
    std::vector<at::ScalarType> storage_dtype;
    py::object counters = owned(PyList_New(versions_ ? n : 0));
    py::object cdatas = owned(PyList_New(versions_ ? n : 0));
    bool all_owned = true;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i + kObjectAhead < n) __builtin_prefetch(items[i + kObjectAhead]);
      if (i + kImplAhead < n) fetch_impl(items[i + kImplAhead]);
      if (i + kStorageAhead < n) fetch_storage(items[i + kStorageAhead]);
      PyObject* obj = items[i];
      auto* var = reinterpret_cast<THPVariable*>(obj);
      const at::Tensor& t = THPVariable_Unpack(var);
      refuse_unless_plain(obj, var, t);
      if (!t.is_cpu()) out.on_cpu = false;
      const c10::Storage& storage = t.storage();
      const int64_t fresh = static_cast<int64_t>(out.storages.size());
      // Held by this tensor alone, a storage is new here: no other tensor can share it.
      const int64_t found = storage.use_count() == 1
                                ? -1
                                : index_of.find_or_insert(storage.unsafeGetStorageImpl(), fresh);
      if (found < 0) {
        all_owned = all_owned && owns_its_bytes(storage);
        out.storages.push_back(storage);
        storage_dtype.push_back(t.scalar_type());
        out.addresses.push_back(reinterpret_cast<int64_t>(storage.data()));
        out.sizes.push_back(static_cast<int64_t>(storage.nbytes()));
      } else if (storage_dtype[static_cast<size_t>(found)] != t.scalar_type()) {
        throw NotHandled();  // one storage as two dtypes: flatten refuses it
      }
      // A CPU tensor's device is -1, as describe()'s column has it.
      sink_.column_row(t.scalar_type(), t.sizes(), t.strides(), t.storage_offset(),
                       found < 0 ? fresh : found, t.requires_grad(), t.get_device());
      if (versions_) {
        PyObject* counter = t.is_inference()
                                ? Py_NewRef(Py_None)
                                : PyLong_FromLongLong(t._version());
        if (counter == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(counters.ptr(), i, counter);
        PyObject* id = PyLong_FromVoidPtr(storage.unsafeGetStorageImpl());
        if (id == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(cdatas.ptr(), i, id);
      }
    }
    // Two storages over the same memory must agree on the dtype (flatten refuses it). Storages
    // that each own their allocation cannot share an address: only others need the check.
    if (!all_owned) {
      AddressMap dtype_at(out.storages.size());
      for (size_t s = 0; s < out.storages.size(); ++s) {
        const void* at = reinterpret_cast<const void*>(out.addresses[s]);
        if (at == nullptr) continue;
        const int64_t d = dtype_at.find_or_insert(at, static_cast<int64_t>(storage_dtype[s]));
        if (d >= 0 && d != static_cast<int64_t>(storage_dtype[s])) throw NotHandled();
      }
    }
    sink_.columns_end(out.sizes);
    out.versions = owned(PyList_AsTuple(counters.ptr()));
    out.storage_ids = owned(PyList_AsTuple(cdatas.ptr()));
  }

  // How far ahead the loop fetches a tensor's Python object, then (once that has come) its
  // structure, then its storage's.
  static constexpr Py_ssize_t kObjectAhead = 16;
  static constexpr Py_ssize_t kImplAhead = 8;
  static constexpr Py_ssize_t kStorageAhead = 4;

  static void fetch_impl(PyObject* obj) {
    const char* impl = reinterpret_cast<const char*>(
        THPVariable_Unpack(reinterpret_cast<THPVariable*>(obj)).unsafeGetTensorImpl());
    for (size_t at = 0; at < sizeof(c10::TensorImpl); at += 64) __builtin_prefetch(impl + at);
  }

  static void fetch_storage(PyObject* obj) {
    const c10::TensorImpl* impl =
        THPVariable_Unpack(reinterpret_cast<THPVariable*>(obj)).unsafeGetTensorImpl();
    // Read without the accessor's checks (a tensor without storage has a null one here; one
    // that refuses access is refused in the pass itself).
    const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
    if (storage == nullptr) return;
    __builtin_prefetch(storage);
    __builtin_prefetch(reinterpret_cast<const char*>(storage) + 64);
  }

  // Whether the storage's bytes are an allocation of torch's CPU allocator that it owns (no
  // other live storage then starts at its address), or it has none.
  static bool owns_its_bytes(const c10::Storage& storage) {
    const at::DataPtr& data = storage.data_ptr();
    if (data.get() == nullptr) return true;
    static const c10::DeleterFnPtr cpu = c10::GetCPUAllocator()->raw_deleter();
    static const c10::DeleterFnPtr default_cpu = c10::GetDefaultCPUAllocator()->raw_deleter();
    const c10::DeleterFnPtr deleter = data.get_deleter();
    return deleter != nullptr && (deleter == cpu || deleter == default_cpu) &&
           data.get_context() == data.get();
  }

  // describe()'s refusals: only a plain dense CPU/CUDA tensor with no Python state.
  void refuse_unless_plain(PyObject* obj, THPVariable* var, const at::Tensor& t) {
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (t.layout() != at::kStrided || t.is_nested() || !t.has_storage() ||
        impl->has_symbolic_sizes_strides()) {
      throw NotHandled();
    }
    const at::ScalarType dtype = t.scalar_type();
    if (c10::isQIntType(dtype) || p_.refused[static_cast<size_t>(dtype)]) throw NotHandled();
    const auto device = t.device().type();
    if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) throw NotHandled();
    if ((c10::isComplexType(dtype) && t.is_conj()) || t.is_neg()) throw NotHandled();
    if (var->backward_hooks != nullptr) {
      const int hooks = PyObject_IsTrue(var->backward_hooks);
      if (hooks < 0) throw py::error_already_set();
      if (hooks) throw NotHandled();
    }
    PyObject** attrs = _PyObject_GetDictPtr(obj);
    if (attrs != nullptr && *attrs != nullptr && PyDict_GET_SIZE(*attrs) > 0) throw NotHandled();
  }

  const Policy& p_;
  Sink sink_;
  bool versions_;
  AddressMap seen_;
  bool keep_tensors_;
  std::vector<PyObject*> tensors_;
  py::object ints_;
  int unmemoized_ = 0;  // how many tuples or attribute dicts the walk is inside
};

template <class Sink>
py::object walk_with(const Policy& p, py::handle obj, bool versions, bool keep_tensors) {
  try {
    Walker<Sink> walker(p, versions, keep_tensors);
    return py::cast(walker.run(obj.ptr()).release(), py::return_value_policy::take_ownership);
  } catch (const NotHandled&) {
    return py::none();
  } catch (const c10::Error&) {
    return py::none();  // a getter torch refuses for this tensor: the Python walk decides
  }
}

py::object walk(const Policy& p, py::handle obj, bool reference, bool versions) {
  return reference ? walk_with<TupleSink>(p, obj, versions, true)
                   : walk_with<BytesSink>(p, obj, versions, versions);
}

}  // namespace

void register_walk(py::module_& m) {
  py::class_<Policy>(m, "WalkPolicy")
      .def(py::init<py::object, py::object, py::object, const py::list&>(),
           "What the walk compares by identity (the tensor class, OrderedDict), the reference "
           "key's marker, and the dtypes it refuses.");
  py::class_<Walked>(m, "Walked")
      .def_readonly("key", &Walked::key)
      .def_readonly("tensors", &Walked::tensors)
      .def_readonly("ints", &Walked::ints)
      .def_readonly("versions", &Walked::versions)
      .def_readonly("storage_ids", &Walked::storage_ids)
      .def_readonly("columns", &Walked::columns)
      .def_readonly("on_cpu", &Walked::on_cpu)
      .def("__len__", [](const Walked& w) { return w.storages.size(); })
      .def("addresses", &Walked::addresses_now)
      .def("sizes", &Walked::sizes_now)
      .def("storages", &Walked::storage_objects)
      .def("release", &Walked::release,
           "Let the storages go (the copy is done); storages() is empty from then on.");
  m.def("walk", &walk, py::arg("policy"), py::arg("obj"), py::arg("reference"),
        py::arg("versions"),
        "The plan key of obj and its tensors' storages (see _walk.cpp), or None where the "
        "Python walk must decide.");
}
