// Tests use the same float64 oracle as the CLI smoke check (client/reference.h).
#pragma once

#include "client/reference.h"
