/* A stand-in for the CUDA driver (libcuda.so.1) for tests on machines without a GPU.

   It is NOT a GPU and runs no kernel: device memory is host memory, copies are memcpy, streams and
   events are always finished. It checks what only our side decides: that cuda-bindings accepts the
   arguments flowjit's runtime passes, and which calls the runtime makes with which values. Every
   call is written to the file $FAKE_CUDA_LOG, one line each (addresses in decimal); cuLaunchKernel writes each kernel
   parameter, sized by the `.param` list of the kernel's PTX (the driver reads its own copy of that
   list from the module; of a cubin's kernels it logs none). FAKE_CUDA_EVENT_NEVER_READY=1 makes
   every event pending forever (a hung kernel); FAKE_CUDA_NO_DEVICE=1 shows no device;
   FAKE_CUDA_DEVICES=N shows N devices (default 1), sharing one context and host memory;
   FAKE_CUDA_FAIL_MODULE_LOAD=1 makes loading any
   module fail (CUDA_ERROR_INVALID_IMAGE). `fake_cuda_set_launch_hook` lets a test run the launches.

   Build: cc -shared -fPIC -o libcuda.so.1 fake_libcuda.c -ldl */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
#define OK 0
#define NOT_READY 600
#define INVALID_IMAGE 200
#define NOT_FOUND 500

static FILE *log_file(void) {
    static FILE *f;
    if (!f) {
        const char *path = getenv("FAKE_CUDA_LOG");
        f = fopen(path ? path : "/dev/null", "w");
        setvbuf(f, NULL, _IOLBF, 0);
    }
    return f;
}

static void *self(void) {
    static void *handle;
    if (!handle) {
        Dl_info info;
        dladdr((void *)self, &info);
        handle = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    }
    return handle;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
    *pfn = dlsym(self(), symbol);
    if (status) *status = *pfn ? 0 : 1;
    return *pfn ? OK : NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

CUresult cuInit(unsigned flags) { fprintf(log_file(), "cuInit %u\n", flags); return OK; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return OK; }
static int device_count(void) {
    const char *none = getenv("FAKE_CUDA_NO_DEVICE"), *devices = getenv("FAKE_CUDA_DEVICES");
    if (none && *none == '1') return 0;
    return devices ? atoi(devices) : 1;
}
CUresult cuDeviceGetCount(int *count) { *count = device_count(); return OK; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = ordinal; return ordinal >= 0 && ordinal < device_count() ? OK : 101; }

CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
    *value = attribute == 75 ? 9 : attribute == 76 ? 0 : 0; /* compute capability 9.0 */
    return OK;
}

CUresult cuDeviceGetName(char *name, int length, int device) {
    strncpy(name, "fake CUDA driver (no GPU)", length);
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(void **context, int device) {
    *context = (void *)0xC0;
    fprintf(log_file(), "cuDevicePrimaryCtxRetain %d\n", device);
    return OK;
}

CUresult cuDevicePrimaryCtxRelease(int device) { fprintf(log_file(), "cuDevicePrimaryCtxRelease %d\n", device); return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int device) { return cuDevicePrimaryCtxRelease(device); }
CUresult cuCtxSetCurrent(void *context) { return context == (void *)0xC0 ? OK : 201; }
/* The AOT library's runtime makes its context current around its work, as a library should. */
CUresult cuCtxPushCurrent_v2(void *context) {
    fprintf(log_file(), "cuCtxPushCurrent_v2\n");
    return context == (void *)0xC0 ? OK : 201;
}
CUresult cuCtxPopCurrent_v2(void **context) {
    fprintf(log_file(), "cuCtxPopCurrent_v2\n");
    if (context) *context = (void *)0xC0;
    return OK;
}

CUresult cuMemAlloc(uint64_t *pointer, size_t bytes) {
    *pointer = (uint64_t)(uintptr_t)calloc(1, bytes);
    fprintf(log_file(), "cuMemAlloc %zu %llu\n", bytes, (unsigned long long)*pointer);
    return OK;
}
CUresult cuMemAlloc_v2(uint64_t *pointer, size_t bytes) { return cuMemAlloc(pointer, bytes); }

CUresult cuMemFree(uint64_t pointer) {
    fprintf(log_file(), "cuMemFree %llu\n", (unsigned long long)pointer);
    free((void *)(uintptr_t)pointer);
    return OK;
}
CUresult cuMemFree_v2(uint64_t pointer) { return cuMemFree(pointer); }

CUresult cuMemHostAlloc(void **pointer, size_t bytes, unsigned flags) {
    *pointer = calloc(1, bytes);
    fprintf(log_file(), "cuMemHostAlloc %zu\n", bytes);
    return OK;
}

CUresult cuMemFreeHost(void *pointer) { free(pointer); fprintf(log_file(), "cuMemFreeHost\n"); return OK; }

CUresult cuMemcpyHtoDAsync(uint64_t dest, const void *source, size_t bytes, void *stream) {
    uint64_t checksum = 0;
    for (size_t i = 0; i < bytes; i++) checksum += ((const unsigned char *)source)[i];
    memcpy((void *)(uintptr_t)dest, source, bytes);
    fprintf(log_file(), "cuMemcpyHtoDAsync %llu %zu %llu\n", (unsigned long long)dest, bytes, (unsigned long long)checksum);
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(uint64_t d, const void *s, size_t n, void *st) { return cuMemcpyHtoDAsync(d, s, n, st); }

CUresult cuMemcpyDtoHAsync(void *dest, uint64_t source, size_t bytes, void *stream) {
    memcpy(dest, (void *)(uintptr_t)source, bytes);
    fprintf(log_file(), "cuMemcpyDtoHAsync %llu %zu\n", (unsigned long long)source, bytes);
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *d, uint64_t s, size_t n, void *st) { return cuMemcpyDtoHAsync(d, s, n, st); }

typedef struct { char *ptx; } Module;
typedef struct { char name[256]; const char *ptx; int count; int sizes[512]; } Function;

/* A test may run each launch itself (tests/gpu_emulator.py): the hook gets the kernel's PTX, its
   name, grid and block, and the parameter pointers cuLaunchKernel was given. */
typedef void (*LaunchHook)(const char *ptx, const char *name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                           unsigned by, unsigned bz, void **params, int count);
static LaunchHook launch_hook;
void fake_cuda_set_launch_hook(LaunchHook hook) { launch_hook = hook; }

CUresult cuModuleLoadDataEx(Module **module, const void *image, unsigned count, void *options, void **values) {
    const char *text = image;
    const char *fail = getenv("FAKE_CUDA_FAIL_MODULE_LOAD");
    if (fail && *fail == '1') {
        fprintf(log_file(), "cuModuleLoadDataEx refused\n");
        return INVALID_IMAGE;
    }
    *module = calloc(1, sizeof(Module));
    if (memcmp(text, "\x7f" "ELF", 4) == 0) { /* a cubin: kept opaque, its parameters unknown */
        fprintf(log_file(), "cuModuleLoadDataEx cubin %u\n", count);
        return OK;
    }
    (*module)->ptx = strdup(text);
    fprintf(log_file(), "cuModuleLoadDataEx ptx %zu %u\n", strlen(text), count);
    return OK;
}

CUresult cuModuleGetFunction(Function **function, Module *module, const char *name) {
    Function *f = calloc(1, sizeof(Function));
    strncpy(f->name, name, sizeof f->name - 1);
    *function = f;
    if (!module->ptx) {
        f->count = -1;
        fprintf(log_file(), "cuModuleGetFunction %s cubin\n", name);
        return OK;
    }
    f->ptx = module->ptx;
    char entry[300];
    snprintf(entry, sizeof entry, ".entry %s(", name);
    const char *at = strstr(module->ptx, entry);
    if (!at) return NOT_FOUND;
    const char *end = strchr(at, ')');
    for (const char *p = strstr(at, ".param ."); p && p < end; p = strstr(p + 1, ".param .")) {
        const char *type = p + 8; /* u64, f32, b16, ... */
        f->sizes[f->count++] = atoi(type + 1) / 8;
    }
    fprintf(log_file(), "cuModuleGetFunction %s %d\n", name, f->count);
    return OK;
}

CUresult cuModuleUnload(Module *module) { fprintf(log_file(), "cuModuleUnload\n"); return OK; }

CUresult cuLaunchKernel(Function *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
    FILE *out = log_file();
    fprintf(out, "cuLaunchKernel %s %u %u %u %u %u %u %u", f->name, gx, gy, gz, bx, by, bz, shared);
    for (int i = 0; i < f->count; i++) {
        uint64_t value = 0;
        memcpy(&value, params[i], f->sizes[i]);
        fprintf(out, " %llu", (unsigned long long)value);
    }
    fprintf(out, "\n");
    if (launch_hook) launch_hook(f->ptx, f->name, gx, gy, gz, bx, by, bz, params, f->count);
    return OK;
}

CUresult cuStreamCreate(void **stream, unsigned flags) {
    *stream = (void *)0x5;
    fprintf(log_file(), "cuStreamCreate %u\n", flags);
    return OK;
}
CUresult cuStreamDestroy(void *stream) { fprintf(log_file(), "cuStreamDestroy\n"); return OK; }
CUresult cuStreamDestroy_v2(void *stream) { return cuStreamDestroy(stream); }
CUresult cuEventCreate(void **event, unsigned flags) { *event = (void *)0xE; return OK; }
CUresult cuEventDestroy(void *event) { return OK; }
CUresult cuEventDestroy_v2(void *event) { return OK; }
CUresult cuEventRecord(void *event, void *stream) { fprintf(log_file(), "cuEventRecord\n"); return OK; }

CUresult cuEventQuery(void *event) {
    const char *never = getenv("FAKE_CUDA_EVENT_NEVER_READY");
    return never && *never == '1' ? NOT_READY : OK;
}

CUresult cuGetErrorName(CUresult error, const char **text) {
    *text = error == NOT_READY ? "CUDA_ERROR_NOT_READY" : "CUDA_ERROR_FAKE";
    return OK;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    *text = "an error of the fake driver";
    return OK;
}
