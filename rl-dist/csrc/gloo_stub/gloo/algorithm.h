// Stand-in for Gloo's header of the same name: see README.md in this folder.
#pragma once
#include <gloo/stub_decls.h>
