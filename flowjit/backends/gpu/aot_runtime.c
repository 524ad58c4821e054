/* The runtime of a flowjit CUDA library (`flowjit compile --target cuda`), pasted into every
 * generated NAME.c after its tables (flowjit/backends/gpu/aot_c.py writes them):
 *
 *   LIBRARY_NAME, NUM_MODULES, module_images[]     the kernels: PTX, and a cubin where ptxas ran
 *   CUBIN_MAJOR/CUBIN_MINOR, PTX_TARGET            the chip of the cubins and of the PTX
 *   ARENA_BYTES, STAGING_BYTES                     device memory of all buffers, pinned host bytes
 *   NUM_INPUTS/NUM_OUTPUTS, input_/output_ tables  where each input and output lives
 *   run_plan(arena)                                the launch plan (defined after this file)
 *
 * It loads the driver with dlopen (FLOWJIT_LIBCUDA, else libcuda.so.1) and resolves the driver
 * functions it calls with dlsym: no CUDA header or library is needed to build it. Everything is
 * static: several flowjit libraries in one program share nothing. One call at a time (a mutex):
 * the library owns one stream, one device block holding every buffer, one pinned staging block.
 * Not yet run against a real driver (docs/aot.md). */

/* The driver API's types and the few constants used, as cuda.h declares them. */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_STREAM_NON_BLOCKING 1
#define CU_EVENT_DISABLE_TIMING 2
#define CU_JIT_ERROR_LOG_BUFFER 5
#define CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES 6

/* How long a call may wait for its GPU work when FLOWJIT_GPU_TIMEOUT_S is not set (seconds). */
#define DEFAULT_TIMEOUT_S 120.0
/* Arrays of one entry per module (C has no empty arrays: a plan may launch nothing). */
#define MODULE_SLOTS (NUM_MODULES > 0 ? NUM_MODULES : 1)

struct module_image {
  const char* module;   /* the kernel module's name (gpu.module) */
  const char* function; /* its kernel's .entry */
  const unsigned char* ptx;
  size_t ptx_bytes; /* with the terminating NUL */
  const unsigned char* cubin;
  size_t cubin_bytes; /* 0: no cubin (ptxas was not found at compile time) */
};

/* The driver functions, resolved from the driver library. The names are the ABI's: cuda.h maps
 * cuMemAlloc to cuMemAlloc_v2 and so on. */
static struct {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuModuleLoadDataEx)(CUmodule*, const void*, unsigned, int*, void**);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuGetErrorName)(CUresult, const char**);   /* optional */
  CUresult (*cuGetErrorString)(CUresult, const char**); /* optional */
} cu;

static const struct {
  const char* symbol;
  void* slot; /* the address of the function pointer in `cu` */
  int optional;
} driver_functions[] = {
    {"cuInit", &cu.cuInit, 0},
    {"cuDeviceGetCount", &cu.cuDeviceGetCount, 0},
    {"cuDeviceGet", &cu.cuDeviceGet, 0},
    {"cuDeviceGetAttribute", &cu.cuDeviceGetAttribute, 0},
    {"cuDevicePrimaryCtxRetain", &cu.cuDevicePrimaryCtxRetain, 0},
    {"cuDevicePrimaryCtxRelease_v2", &cu.cuDevicePrimaryCtxRelease, 0},
    {"cuCtxPushCurrent_v2", &cu.cuCtxPushCurrent, 0},
    {"cuCtxPopCurrent_v2", &cu.cuCtxPopCurrent, 0},
    {"cuModuleLoadDataEx", &cu.cuModuleLoadDataEx, 0},
    {"cuModuleGetFunction", &cu.cuModuleGetFunction, 0},
    {"cuModuleUnload", &cu.cuModuleUnload, 0},
    {"cuMemAlloc_v2", &cu.cuMemAlloc, 0},
    {"cuMemFree_v2", &cu.cuMemFree, 0},
    {"cuMemHostAlloc", &cu.cuMemHostAlloc, 0},
    {"cuMemFreeHost", &cu.cuMemFreeHost, 0},
    {"cuMemcpyHtoDAsync_v2", &cu.cuMemcpyHtoDAsync, 0},
    {"cuMemcpyDtoHAsync_v2", &cu.cuMemcpyDtoHAsync, 0},
    {"cuStreamCreate", &cu.cuStreamCreate, 0},
    {"cuStreamDestroy_v2", &cu.cuStreamDestroy, 0},
    {"cuEventCreate", &cu.cuEventCreate, 0},
    {"cuEventRecord", &cu.cuEventRecord, 0},
    {"cuEventQuery", &cu.cuEventQuery, 0},
    {"cuEventDestroy_v2", &cu.cuEventDestroy, 0},
    {"cuLaunchKernel", &cu.cuLaunchKernel, 0},
    {"cuGetErrorName", &cu.cuGetErrorName, 1},
    {"cuGetErrorString", &cu.cuGetErrorString, 1},
};

/* What the library holds between calls (guarded by `lock`). */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  void* driver;    /* the dlopen handle, kept once loaded */
  int initialized; /* cuInit succeeded */
  int ordinal;     /* the device to use (set_device), 0 by default */
  int loaded;      /* everything below is made */
  CUdevice device;
  CUcontext context; /* the device's primary context, retained */
  CUmodule modules[MODULE_SLOTS];
  CUfunction functions[MODULE_SLOTS];
  CUstream stream;
  CUevent done;
  CUdeviceptr arena; /* every buffer of the plan, at its offset */
  void* staging;     /* pinned: the inputs, then the outputs */
  int broken;        /* a call did not finish: its status; every later call returns it */
  char why_broken[512];
} state;

/* The message of the last failing call on this thread ("" after a success). */
static _Thread_local char last_error[2048];

static int fail(int status, const char* format, ...) __attribute__((format(printf, 2, 3)));
static int fail(int status, const char* format, ...) {
  int at = snprintf(last_error, sizeof last_error, "%s: ", LIBRARY_NAME);
  if (at < 0 || (size_t)at >= sizeof last_error) return status;
  va_list args;
  va_start(args, format);
  vsnprintf(last_error + at, sizeof last_error - (size_t)at, format, args);
  va_end(args);
  return status;
}

/* "CUDA_ERROR_NAME: the driver's description", or the number where the driver cannot say. */
static void describe(CUresult result, char* text, size_t bytes) {
  const char* name = NULL;
  const char* description = NULL;
  if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(result, &name) != CUDA_SUCCESS) name = NULL;
  if (cu.cuGetErrorString == NULL || cu.cuGetErrorString(result, &description) != CUDA_SUCCESS) description = NULL;
  if (name == NULL) {
    snprintf(text, bytes, "CUresult %d", result);
  } else if (description == NULL) {
    snprintf(text, bytes, "%s", name);
  } else {
    snprintf(text, bytes, "%s: %s", name, description);
  }
}

/* FLOWJIT_OK, or FLOWJIT_ERROR_CUDA with "CALL failed: CUDA_ERROR_...: ..." as the last error. */
static int check(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return FLOWJIT_OK;
  char text[512];
  describe(result, text, sizeof text);
  return fail(FLOWJIT_ERROR_CUDA, "%s failed: %s", call, text);
}

#define CHECK(call, name)                          \
  do {                                             \
    int status_ = check((call), (name));           \
    if (status_ != FLOWJIT_OK) return status_;     \
  } while (0)

/* dlopen the driver and resolve its functions (once), then cuInit (until it succeeds). */
static int open_driver(void) {
  if (state.driver == NULL) {
    const char* path = getenv("FLOWJIT_LIBCUDA");
    if (path == NULL || *path == '\0') path = "libcuda.so.1";
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
      const char* why = dlerror();
      return fail(FLOWJIT_ERROR_NO_GPU,
                  "cannot load the CUDA driver %s: %s. The library runs where an NVIDIA driver is installed; "
                  "FLOWJIT_LIBCUDA may name the driver library's path",
                  path, why ? why : "unknown reason");
    }
    for (size_t i = 0; i < sizeof driver_functions / sizeof driver_functions[0]; i++) {
      void* function = dlsym(handle, driver_functions[i].symbol);
      if (function == NULL && !driver_functions[i].optional) {
        memset(&cu, 0, sizeof cu);
        dlclose(handle);
        return fail(FLOWJIT_ERROR_NO_GPU, "the CUDA driver %s has no function %s (a driver older than CUDA 11?)",
                    path, driver_functions[i].symbol);
      }
      memcpy(driver_functions[i].slot, &function, sizeof function);
    }
    state.driver = handle;
  }
  if (!state.initialized) {
    CUresult result = cu.cuInit(0);
    if (result != CUDA_SUCCESS) {
      char text[512];
      describe(result, text, sizeof text);
      return fail(FLOWJIT_ERROR_NO_GPU, "no usable CUDA driver: cuInit failed: %s", text);
    }
    state.initialized = 1;
  }
  return FLOWJIT_OK;
}

/* Free what `load` made; the primary context is current (pushed) when `pushed`. */
static void unload(int pushed) {
  for (int i = 0; i < NUM_MODULES; i++) {
    if (state.modules[i] != NULL) cu.cuModuleUnload(state.modules[i]);
    state.modules[i] = NULL;
    state.functions[i] = NULL;
  }
  if (state.arena) cu.cuMemFree(state.arena);
  if (state.staging) cu.cuMemFreeHost(state.staging);
  if (state.done) cu.cuEventDestroy(state.done);
  if (state.stream) cu.cuStreamDestroy(state.stream);
  state.arena = 0;
  state.staging = NULL;
  state.done = NULL;
  state.stream = NULL;
  if (pushed) {
    CUcontext popped;
    cu.cuCtxPopCurrent(&popped);
  }
  if (state.context != NULL) cu.cuDevicePrimaryCtxRelease(state.device);
  state.context = NULL;
  state.loaded = 0;
}

/* Load module `i`: its cubin where it was built for this device's major version and an earlier
 * or equal minor one, else its PTX through the driver's JIT (refused for a later chip). */
static int load_module(int i, int major, int minor) {
  const struct module_image* image = &module_images[i];
  int use_cubin = image->cubin_bytes > 0 && major == CUBIN_MAJOR && minor >= CUBIN_MINOR;
  if (!use_cubin && major * 10 + minor < PTX_TARGET) {
    return fail(FLOWJIT_ERROR_NO_GPU,
                "kernel %s was compiled for sm_%d, but device %d is sm_%d%d: compile with --target cuda-sm_%d%d "
                "(or an earlier chip)",
                image->module, PTX_TARGET, state.ordinal, major, minor, major, minor);
  }
  char log[4096] = "";
  int options[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[2] = {log, (void*)(uintptr_t)sizeof log};
  CUresult result = use_cubin ? cu.cuModuleLoadDataEx(&state.modules[i], image->cubin, 0, NULL, NULL)
                              : cu.cuModuleLoadDataEx(&state.modules[i], image->ptx, 2, options, values);
  if (result != CUDA_SUCCESS) {
    state.modules[i] = NULL;
    char text[512];
    describe(result, text, sizeof text);
    log[sizeof log - 1] = '\0';
    return fail(FLOWJIT_ERROR_CUDA, "cuModuleLoadDataEx failed for kernel %s (%s): %s%s%s", image->module,
                use_cubin ? "cubin" : "PTX", text, log[0] ? "; JIT log: " : "", log);
  }
  result = cu.cuModuleGetFunction(&state.functions[i], state.modules[i], image->function);
  if (result != CUDA_SUCCESS) {
    char text[512];
    describe(result, text, sizeof text);
    return fail(FLOWJIT_ERROR_CUDA, "cuModuleGetFunction failed for %s in kernel %s: %s", image->function,
                image->module, text);
  }
  return FLOWJIT_OK;
}

/* Make everything a call needs, once (the first call, or the first after release/set_device):
 * the context of the chosen device, the modules, a stream, an event, the device arena and the
 * pinned staging block. Nothing is kept when a step fails, so a later call tries again. */
static int load(void) {
  int status = open_driver();
  if (status != FLOWJIT_OK) return status;
  int count = 0;
  CHECK(cu.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (count == 0) return fail(FLOWJIT_ERROR_NO_GPU, "no CUDA device: the driver reports 0 devices");
  if (state.ordinal >= count) {
    return fail(FLOWJIT_ERROR_NO_GPU, "no CUDA device %d: the driver shows %d device(s)", state.ordinal, count);
  }
  CHECK(cu.cuDeviceGet(&state.device, state.ordinal), "cuDeviceGet");
  int major = 0, minor = 0;
  CHECK(cu.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, state.device),
        "cuDeviceGetAttribute");
  CHECK(cu.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, state.device),
        "cuDeviceGetAttribute");
  state.context = NULL;
  CHECK(cu.cuDevicePrimaryCtxRetain(&state.context, state.device), "cuDevicePrimaryCtxRetain");
  status = check(cu.cuCtxPushCurrent(state.context), "cuCtxPushCurrent_v2");
  if (status != FLOWJIT_OK) {
    unload(0);
    return status;
  }
  for (int i = 0; i < NUM_MODULES && status == FLOWJIT_OK; i++) status = load_module(i, major, minor);
  if (status == FLOWJIT_OK) status = check(cu.cuStreamCreate(&state.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  if (status == FLOWJIT_OK) status = check(cu.cuEventCreate(&state.done, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  if (status == FLOWJIT_OK) status = check(cu.cuMemAlloc(&state.arena, ARENA_BYTES), "cuMemAlloc_v2");
  if (status == FLOWJIT_OK) status = check(cu.cuMemHostAlloc(&state.staging, STAGING_BYTES, 0), "cuMemHostAlloc");
  if (status != FLOWJIT_OK) {
    unload(1);
    return status;
  }
  CUcontext popped;
  status = check(cu.cuCtxPopCurrent(&popped), "cuCtxPopCurrent_v2");
  if (status != FLOWJIT_OK) {
    unload(0);
    return status;
  }
  state.loaded = 1;
  return FLOWJIT_OK;
}

/* Launch kernel module `module` on the library's stream (unused by a plan without launches). */
__attribute__((unused)) static int launch(int module, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                  unsigned shared_bytes, void** params) {
  CUresult result = cu.cuLaunchKernel(state.functions[module], gx, gy, gz, bx, by, bz, shared_bytes, state.stream,
                                      params, NULL);
  if (result == CUDA_SUCCESS) return FLOWJIT_OK;
  char text[512];
  describe(result, text, sizeof text);
  return fail(FLOWJIT_ERROR_CUDA, "cuLaunchKernel failed for kernel %s: %s", module_images[module].module, text);
}

static double monotonic_seconds(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* FLOWJIT_GPU_TIMEOUT_S (read per call), else DEFAULT_TIMEOUT_S. */
static int timeout_seconds(double* seconds) {
  const char* raw = getenv("FLOWJIT_GPU_TIMEOUT_S");
  *seconds = DEFAULT_TIMEOUT_S;
  if (raw == NULL) return FLOWJIT_OK;
  char* end = NULL;
  double value = strtod(raw, &end);
  if (end == raw || *end != '\0' || !(value > 0) || value > 1e9) {
    return fail(FLOWJIT_ERROR_INVALID_SETTING, "FLOWJIT_GPU_TIMEOUT_S must be a positive number of seconds; found '%s'",
                raw);
  }
  *seconds = value;
  return FLOWJIT_OK;
}

/* Record the event after the stream's work and poll it until done, at most `seconds`: spin for
 * 200 us (short work), then sleep 20 us doubling up to 1 ms between polls. Never unbounded. */
static int wait_for_stream(double seconds) {
  CHECK(cu.cuEventRecord(state.done, state.stream), "cuEventRecord");
  double start = monotonic_seconds();
  double deadline = start + seconds, spin_until = start + 200e-6;
  long pause_ns = 20000;
  for (;;) {
    CUresult result = cu.cuEventQuery(state.done);
    if (result == CUDA_SUCCESS) return FLOWJIT_OK;
    if (result != CUDA_ERROR_NOT_READY) return check(result, "cuEventQuery");
    double now = monotonic_seconds();
    if (now < spin_until) continue;
    if (now > deadline) {
      return fail(FLOWJIT_ERROR_TIMEOUT,
                  "the GPU did not finish within %g s (FLOWJIT_GPU_TIMEOUT_S sets the limit); its work may still be "
                  "running, so the library refuses later calls",
                  seconds);
    }
    struct timespec pause = {0, pause_ns};
    nanosleep(&pause, NULL);
    pause_ns = pause_ns * 2 < 1000000 ? pause_ns * 2 : 1000000;
  }
}

static int run_plan(CUdeviceptr arena);

/* One call with the context current: inputs into the pinned block and to the device, the plan,
 * outputs back to the pinned block, the bounded wait, then the outputs to the caller. */
static int run_pushed(const void** in, void** out, double seconds) {
  char* staging = state.staging;
  for (int i = 0; i < NUM_INPUTS; i++) {
    if (input_bytes[i] == 0) continue;
    memcpy(staging + input_staging[i], in[i], input_bytes[i]);
    CHECK(cu.cuMemcpyHtoDAsync(state.arena + input_offsets[i], staging + input_staging[i], input_bytes[i],
                               state.stream),
          "cuMemcpyHtoDAsync_v2");
  }
  int status = run_plan(state.arena);
  if (status != FLOWJIT_OK) return status;
  for (int i = 0; i < NUM_OUTPUTS; i++) {
    if (output_bytes[i] == 0) continue;
    CHECK(cu.cuMemcpyDtoHAsync(staging + output_staging[i], state.arena + output_offsets[i], output_bytes[i],
                               state.stream),
          "cuMemcpyDtoHAsync_v2");
  }
  status = wait_for_stream(seconds);
  if (status != FLOWJIT_OK) return status;
  for (int i = 0; i < NUM_OUTPUTS; i++) {
    if (output_bytes[i] > 0) memcpy(out[i], staging + output_staging[i], output_bytes[i]);
  }
  return FLOWJIT_OK;
}

/* A whole call, under the lock. A call that fails once work may be queued on the stream leaves
 * the library broken: the GPU may still use its buffers, so no later call may reuse them. */
static int call_locked(const void** in, void** out) {
  if (state.broken) return fail(state.broken, "%s", state.why_broken);
  double seconds;
  int status = timeout_seconds(&seconds);
  if (status != FLOWJIT_OK) return status;
  if (!state.loaded) {
    status = load();
    if (status != FLOWJIT_OK) return status;
  }
  status = check(cu.cuCtxPushCurrent(state.context), "cuCtxPushCurrent_v2");
  if (status != FLOWJIT_OK) return status;
  status = run_pushed(in, out, seconds);
  CUcontext popped;
  cu.cuCtxPopCurrent(&popped);
  if (status != FLOWJIT_OK) {
    size_t prefix = strlen(LIBRARY_NAME) + 2; /* "NAME: " */
    state.broken = status;
    snprintf(state.why_broken, sizeof state.why_broken, "an earlier call failed, so the library cannot run again: %.400s",
             strlen(last_error) > prefix ? last_error + prefix : last_error);
  }
  return status;
}

static int call(const void** in, void** out) {
  last_error[0] = '\0';
  pthread_mutex_lock(&lock);
  int status = call_locked(in, out);
  pthread_mutex_unlock(&lock);
  return status;
}

/* Give back the modules, the memory, the stream and the primary context. */
static int release_locked(void) {
  if (state.broken) return fail(state.broken, "%s", state.why_broken);
  if (!state.loaded) return FLOWJIT_OK;
  int status = check(cu.cuCtxPushCurrent(state.context), "cuCtxPushCurrent_v2");
  unload(status == FLOWJIT_OK);
  return status;
}

static int release(void) {
  last_error[0] = '\0';
  pthread_mutex_lock(&lock);
  int status = release_locked();
  pthread_mutex_unlock(&lock);
  return status;
}

static int set_device(int ordinal) {
  last_error[0] = '\0';
  if (ordinal < 0) return fail(FLOWJIT_ERROR_INVALID_SETTING, "device %d: expected a device number >= 0", ordinal);
  pthread_mutex_lock(&lock);
  int status = FLOWJIT_OK;
  if (ordinal != state.ordinal) {
    status = release_locked();
    if (status == FLOWJIT_OK) state.ordinal = ordinal;
  }
  pthread_mutex_unlock(&lock);
  return status;
}
