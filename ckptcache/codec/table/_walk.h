// The walk of a save's object for its plan key (_walk.cpp), registered in the module of
// _tensors.cpp: one extension, built and loaded together.
#pragma once

#include <torch/extension.h>

void register_walk(pybind11::module_& m);
