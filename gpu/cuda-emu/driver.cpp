// The CUDA driver API as far as cudarc and the CUDA executor call it, over host memory: one
// device ("lockstep CUDA emulator", compute capability 9.0, so the sm_90 paths such as dependent
// launches are the ones taken), device pointers that are host pointers, and every operation run
// to completion before the call that queued it returns (a launch's blocks on the host's cores,
// blocks.cpp), so a stream is always idle. Graph capture records launches and copies with their
// arguments; a replay runs them again in order.
//
// A kernel module is what the emulator's NVRTC (nvrtc.cpp) built: the image names a shared
// library, which is opened and asked for its entry points. A failed launch (a trap, a divergent
// barrier) prints why to stderr and, as on a device, fails every later call of the context.
//
// Fresh allocations are filled with 0xff bytes (NaN, or -1 as an index), as a device's hold
// garbage. Every allocation ends at a page that cannot be touched, so a kernel reading past the
// end of a buffer (beyond the 256-byte rounding the device's allocator also has) faults there,
// and the fault names the kernel (see `on_fault`).

#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "blocks.h"
#include "image.h"
#include "runtime.h"

using lockstep_emu::Dim;
using lockstep_emu::Entry;
using lockstep_emu::Module;

namespace {

// The driver API's types, as its C header declares them.
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
};

constexpr int ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1;
constexpr int ATTRIBUTE_WARP_SIZE = 10;
constexpr int ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;

// The device's memory: 16 GiB, or $LOCKSTEP_CUDA_EMU_MEMORY bytes (a test of what runs out).
std::size_t total_memory() {
    static const std::size_t total = [] {
        const char* set = std::getenv("LOCKSTEP_CUDA_EMU_MEMORY");
        return set != nullptr && *set ? std::strtoull(set, nullptr, 10) : std::size_t{16} << 30;
    }();
    return total;
}
// How many of a kernel's dependent launches on a stream run checked (`run_launch`).
constexpr unsigned int CHECKED_LAUNCHES_PER_KERNEL = 32;
constexpr std::size_t PAGE = 4096;
// The device allocator's alignment: a buffer starts this far below its guard page, rounded up.
constexpr std::size_t ALIGNMENT = 256;

}  // namespace

// The handles, opaque to the caller.
struct CUctx_st {
    int unused;
};
struct CUmod_st {
    void* library;
    const Module* module;
};
struct CUfunc_st {
    const Module* module;
    const Entry* entry;
};
struct CUevent_st {
    int unused;
};

namespace {

// One recorded operation of a captured stream.
struct Operation {
    enum class Kind { Launch, Copy, Fill };
    explicit Operation(Kind kind) : kind(kind) {}
    Kind kind;
    const CUfunc_st* function = nullptr;
    Dim grid{}, block{};
    std::vector<std::vector<unsigned char>> arguments;  // each parameter's bytes
    void* destination = nullptr;
    const void* source = nullptr;
    std::size_t bytes = 0;
    unsigned char value = 0;
    bool dependent = false;  // a programmatic dependent launch
};

}  // namespace

struct CUgraph_st {
    std::vector<Operation> operations;
};
struct CUgraphExec_st {
    std::vector<Operation> operations;
};
struct CUstream_st {
    std::unique_ptr<CUgraph_st> capture;  // while capturing
    // The allocations a kernel on this stream was given to write (a pointer to non-const):
    // what a dependent launch may not touch before `wait_for_inputs()`.
    std::set<CUdeviceptr> written;
    // Dependent launches checked so far, by kernel.
    std::map<const Entry*, unsigned int> checked_launches;
};

typedef CUctx_st* CUcontext;
typedef CUmod_st* CUmodule;
typedef CUfunc_st* CUfunction;
typedef CUstream_st* CUstream;
typedef CUevent_st* CUevent;
typedef CUgraph_st* CUgraph;
typedef CUgraphExec_st* CUgraphExec;

struct CUlaunchAttribute {
    int id;
    char pad[4];
    unsigned char value[64];
};

struct CUlaunchConfig {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute* attrs;
    unsigned int numAttrs;
};

namespace {

CUctx_st the_context;
std::atomic<bool> initialized{false};
// Set by the first failed launch; every later call fails with it, as a device's context does.
std::atomic<CUresult> sticky{CUDA_SUCCESS};

struct Allocation {
    void* mapping;
    std::size_t length;
    std::size_t counted;  // toward `allocated`
};
std::mutex allocations_lock;
std::map<CUdeviceptr, Allocation> allocations;
std::size_t allocated = 0;

// Whether a dependent launch's checked block runs before its `wait_for_inputs()`.
thread_local bool before_wait = false;

struct sigaction previous_fault_action;

void on_fault(int signal, siginfo_t* info, void* context) {
    const char* running_kernel = lockstep_emu::running_kernel();
    if (running_kernel != nullptr) {
        char text[400];
        const int n =
            before_wait
                ? std::snprintf(text, sizeof text,
                                "lockstep cuda emulator: kernel %s touched %p before "
                                "wait_for_inputs() in a dependent launch: memory a kernel "
                                "before it writes, which may still be running on a device (or "
                                "outside every allocation)\n",
                                running_kernel, info->si_addr)
                : std::snprintf(text, sizeof text,
                                "lockstep cuda emulator: kernel %s touched %p, outside every "
                                "allocation (or past the end of one)\n",
                                running_kernel, info->si_addr);
        if (n > 0) (void)!write(2, text, static_cast<std::size_t>(n));
    }
    // Hand the fault on (Rust's handler tells a stack overflow from anything else).
    sigaction(signal, &previous_fault_action, nullptr);
    (void)context;
}

void install_fault_handler() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction action {};
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        sigaction(SIGSEGV, &action, &previous_fault_action);
    });
}

CUresult check() {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    return sticky.load();
}

// $LOCKSTEP_CUDA_EMU_TRACE set: every launch to stderr as it runs, for debugging a kernel.
const bool tracing = std::getenv("LOCKSTEP_CUDA_EMU_TRACE") != nullptr;

// The allocation holding `address`, if any (the caller holds `allocations_lock`).
const Allocation* allocation_at(CUdeviceptr address, CUdeviceptr* base) {
    auto after = allocations.upper_bound(address);
    if (after == allocations.begin()) return nullptr;
    auto found = std::prev(after);
    if (address >= found->first + found->second.counted) return nullptr;
    *base = found->first;
    return &found->second;
}

// Makes every allocation `stream`'s kernels write inaccessible (`closed`) or accessible again.
void set_written(CUstream_st* stream, bool closed) {
    std::lock_guard<std::mutex> guard(allocations_lock);
    for (CUdeviceptr base : stream->written) {
        auto found = allocations.find(base);
        if (found == allocations.end()) continue;  // freed since
        mprotect(found->second.mapping, found->second.length - PAGE,
                 closed ? PROT_NONE : PROT_READ | PROT_WRITE);
    }
    before_wait = closed;
}

CUresult run_launch(const CUfunc_st* function, Dim grid, Dim block, void** parameters,
                    CUstream_st* stream, bool dependent) {
    const Entry& entry = *function->entry;
    if (tracing) {
        std::fprintf(stderr, "lockstep cuda emulator: %s%s grid (%u, %u, %u) block (%u, %u, %u)",
                     entry.name, dependent ? " (dependent)" : "", grid.x, grid.y, grid.z,
                     block.x, block.y, block.z);
        for (unsigned int i = 0; i < entry.parameter_count; i++) {
            unsigned long long value = 0;
            std::memcpy(&value, parameters[i], entry.parameter_sizes[i]);
            std::fprintf(stderr, " %llx", value);
        }
        std::fprintf(stderr, "\n");
    }
    // A dependent launch may start on a device while the kernel before it runs: its checked
    // blocks run with what the stream's kernels write closed until `wait_for_inputs()`.
    const lockstep_emu::PreWaitGuard guard = {
        [](void* s) { set_written(static_cast<CUstream_st*>(s), true); },
        [](void* s) { set_written(static_cast<CUstream_st*>(s), false); },
        stream,
    };
    // Closing and opening a model's buffers (the KV cache is most of its memory) costs more
    // than the launch; a kernel's first dependent launches on a stream are checked, which
    // covers each shape a step takes early on (prefill chunks, decode rows, graph captures).
    const bool checked = dependent && stream != nullptr &&
                         stream->checked_launches[&entry]++ < CHECKED_LAUNCHES_PER_KERNEL;
    const std::string error = lockstep_emu::run_grid(*function->module, entry, grid, block,
                                                     parameters, checked ? &guard : nullptr);
    if (stream != nullptr) {
        // What this kernel may write, the next dependent launch may not touch before its wait.
        std::lock_guard<std::mutex> lock(allocations_lock);
        for (unsigned int i = 0; i < entry.parameter_count; i++) {
            if ((entry.writable >> i & 1u) == 0) continue;
            CUdeviceptr address = 0, base = 0;
            std::memcpy(&address, parameters[i], sizeof address);
            if (allocation_at(address, &base) != nullptr) stream->written.insert(base);
        }
    }
    if (error.empty()) return CUDA_SUCCESS;
    std::fprintf(stderr, "lockstep cuda emulator: kernel %s failed: %s\n", entry.name,
                 error.c_str());
    CUresult expected = CUDA_SUCCESS;
    sticky.compare_exchange_strong(expected, CUDA_ERROR_LAUNCH_FAILED);
    return CUDA_ERROR_LAUNCH_FAILED;
}

CUresult run(const Operation& op, CUstream_st* stream) {
    switch (op.kind) {
        case Operation::Kind::Copy:
            std::memcpy(op.destination, op.source, op.bytes);
            return CUDA_SUCCESS;
        case Operation::Kind::Fill:
            std::memset(op.destination, op.value, op.bytes);
            return CUDA_SUCCESS;
        case Operation::Kind::Launch: {
            std::vector<void*> parameters;
            for (const auto& argument : op.arguments) {
                parameters.push_back(const_cast<unsigned char*>(argument.data()));
            }
            return run_launch(op.function, op.grid, op.block, parameters.data(), stream,
                              op.dependent);
        }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

// Runs `op` now, or records it when `stream` is capturing.
CUresult submit(CUstream stream, Operation op) {
    if (CUresult status = check(); status != CUDA_SUCCESS) return status;
    if (stream != nullptr && stream->capture) {
        stream->capture->operations.push_back(std::move(op));
        return CUDA_SUCCESS;
    }
    return run(op, stream);
}

CUresult copy(CUstream stream, void* destination, const void* source, std::size_t bytes) {
    Operation op(Operation::Kind::Copy);
    op.destination = destination;
    op.source = source;
    op.bytes = bytes;
    return submit(stream, std::move(op));
}

CUresult launch(CUfunction f, Dim grid, Dim block, unsigned int shared_bytes, CUstream stream,
                void** parameters, void** extra, bool dependent) {
    if (f == nullptr || parameters == nullptr || extra != nullptr) return CUDA_ERROR_INVALID_VALUE;
    // Our kernels declare their shared memory; dynamic shared memory is not emulated.
    if (shared_bytes != 0) return CUDA_ERROR_NOT_SUPPORTED;
    Operation op(Operation::Kind::Launch);
    op.function = f;
    op.grid = grid;
    op.block = block;
    op.dependent = dependent;
    for (unsigned int i = 0; i < f->entry->parameter_count; i++) {
        const auto* bytes = static_cast<const unsigned char*>(parameters[i]);
        // Each parameter in a slot of at least 8 bytes: the kernel reads its own size of it.
        std::vector<unsigned char> argument(std::max(8u, f->entry->parameter_sizes[i]));
        std::memcpy(argument.data(), bytes, f->entry->parameter_sizes[i]);
        op.arguments.push_back(std::move(argument));
    }
    return submit(stream, std::move(op));
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned int) {
    install_fault_handler();
    initialized = true;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* version) {
    *version = 12080;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* count) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *count = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int length, CUdevice device) {
    if (device != 0 || length <= 0) return CUDA_ERROR_INVALID_VALUE;
    std::snprintf(name, static_cast<std::size_t>(length), "lockstep CUDA emulator (CPU)");
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(std::size_t* bytes, CUdevice device) {
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = total_memory();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice device) {
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    switch (attribute) {
        case ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
        case ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
        case ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
        case ATTRIBUTE_WARP_SIZE: *value = 32; break;
        case ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 1; break;
        // Memory pools (stream-ordered allocation) and everything else: not here.
        default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    *context = &the_context;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }

// Clears a failed launch's sticky error. A device's reset also frees every allocation; here they
// stay, and the caller drops what it had (only the emulator's own tests reset).
CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) {
    if (device != 0) return CUDA_ERROR_INVALID_DEVICE;
    sticky = CUDA_SUCCESS;
    return CUDA_SUCCESS;
}

thread_local CUcontext current_context = nullptr;

CUresult cuCtxSetCurrent(CUcontext context) {
    current_context = context;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* context) {
    *context = current_context;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* device) {
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize() { return check(); }

CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
    std::lock_guard<std::mutex> guard(allocations_lock);
    *total = total_memory();
    *free = allocated < total_memory() ? total_memory() - allocated : 0;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* pointer, std::size_t bytes) {
    if (CUresult status = check(); status != CUDA_SUCCESS) return status;
    const std::size_t rounded = (bytes + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT;
    const std::size_t usable = (rounded + PAGE - 1) / PAGE * PAGE;
    std::lock_guard<std::mutex> guard(allocations_lock);
    if (allocated + rounded > total_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
    void* mapping = mmap(nullptr, usable + PAGE, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapping == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    auto* guard_page = static_cast<unsigned char*>(mapping) + usable;
    mprotect(guard_page, PAGE, PROT_NONE);
    const auto address = reinterpret_cast<CUdeviceptr>(guard_page - rounded);
    // A device's fresh memory holds whatever was there; here every byte is 0xff (a NaN in f32,
    // f16 and bf16, -1 as an index), so a kernel reading what nothing wrote computes garbage
    // that shows, not the zeros a fresh mapping would give.
    std::memset(guard_page - rounded, 0xff, rounded);
    allocations[address] = Allocation{mapping, usable + PAGE, rounded};
    allocated += rounded;
    *pointer = address;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr pointer) {
    if (pointer == 0) return CUDA_SUCCESS;
    std::lock_guard<std::mutex> guard(allocations_lock);
    auto found = allocations.find(pointer);
    if (found == allocations.end()) return CUDA_ERROR_INVALID_VALUE;
    munmap(found->second.mapping, found->second.length);
    allocated -= found->second.counted;
    allocations.erase(found);
    return CUDA_SUCCESS;
}

CUresult cuMemAllocAsync(CUdeviceptr* pointer, std::size_t bytes, CUstream) {
    return cuMemAlloc_v2(pointer, bytes);
}

CUresult cuMemFreeAsync(CUdeviceptr pointer, CUstream) { return cuMemFree_v2(pointer); }

CUresult cuMemsetD8Async(CUdeviceptr pointer, unsigned char value, std::size_t count,
                         CUstream stream) {
    Operation op(Operation::Kind::Fill);
    op.destination = reinterpret_cast<void*>(pointer);
    op.bytes = count;
    op.value = value;
    return submit(stream, std::move(op));
}

CUresult cuMemsetD8_v2(CUdeviceptr pointer, unsigned char value, std::size_t count) {
    return cuMemsetD8Async(pointer, value, count, nullptr);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr destination, const void* source, std::size_t bytes,
                              CUstream stream) {
    return copy(stream, reinterpret_cast<void*>(destination), source, bytes);
}

CUresult cuMemcpyDtoHAsync_v2(void* destination, CUdeviceptr source, std::size_t bytes,
                              CUstream stream) {
    return copy(stream, destination, reinterpret_cast<const void*>(source), bytes);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr destination, CUdeviceptr source, std::size_t bytes,
                              CUstream stream) {
    return copy(stream, reinterpret_cast<void*>(destination), reinterpret_cast<void*>(source),
                bytes);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr destination, const void* source, std::size_t bytes) {
    return cuMemcpyHtoDAsync_v2(destination, source, bytes, nullptr);
}

CUresult cuMemcpyDtoH_v2(void* destination, CUdeviceptr source, std::size_t bytes) {
    return cuMemcpyDtoHAsync_v2(destination, source, bytes, nullptr);
}

CUresult cuStreamCreate(CUstream* stream, unsigned int) {
    if (CUresult status = check(); status != CUDA_SUCCESS) return status;
    *stream = new CUstream_st();
    return CUDA_SUCCESS;
}

CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned int flags, int) {
    return cuStreamCreate(stream, flags);
}

CUresult cuStreamDestroy_v2(CUstream stream) {
    delete stream;
    return CUDA_SUCCESS;
}

// Everything queued already ran.
CUresult cuStreamSynchronize(CUstream) { return check(); }
CUresult cuStreamQuery(CUstream) { return check(); }
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned int) { return check(); }

CUresult cuStreamBeginCapture_v2(CUstream stream, int) {
    if (stream == nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (stream->capture) return CUDA_ERROR_INVALID_VALUE;
    stream->capture = std::make_unique<CUgraph_st>();
    return check();
}

CUresult cuStreamEndCapture(CUstream stream, CUgraph* graph) {
    if (stream == nullptr || !stream->capture) return CUDA_ERROR_INVALID_VALUE;
    *graph = stream->capture.release();
    return check();
}

CUresult cuStreamIsCapturing(CUstream stream, int* status) {
    *status = stream != nullptr && stream->capture ? 1 : 0;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long) {
    if (graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *exec = new CUgraphExec_st{graph->operations};
    return check();
}

CUresult cuGraphUpload(CUgraphExec, CUstream) { return check(); }

CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    if (exec == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult status = check(); status != CUDA_SUCCESS) return status;
    // A graph launched into a capturing stream would be a child graph: not ours to need.
    if (stream != nullptr && stream->capture) return CUDA_ERROR_NOT_SUPPORTED;
    for (const Operation& op : exec->operations) {
        if (CUresult status = run(op, stream); status != CUDA_SUCCESS) return status;
    }
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph graph) {
    delete graph;
    return CUDA_SUCCESS;
}

CUresult cuGraphExecDestroy(CUgraphExec exec) {
    delete exec;
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* event, unsigned int) {
    *event = new CUevent_st();
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent event) {
    delete event;
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent, CUstream) { return check(); }
CUresult cuEventSynchronize(CUevent) { return check(); }
CUresult cuEventQuery(CUevent) { return check(); }

CUresult cuModuleLoadData(CUmodule* module, const void* image) {
    if (CUresult status = check(); status != CUDA_SUCCESS) return status;
    const std::string library = lockstep_emu::library_of_image(image);
    if (library.empty()) {
        std::fprintf(stderr, "lockstep cuda emulator: a module image not built by the "
                             "emulator's NVRTC (a real cubin or PTX cannot run here)\n");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        std::fprintf(stderr, "lockstep cuda emulator: %s\n", dlerror());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    const auto* table = static_cast<const Module*>(dlsym(handle, "lockstep_emu_module"));
    if (table == nullptr) {
        dlclose(handle);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *module = new CUmod_st{handle, table};
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule module) {
    // The library stays open: a fiber's stack may still hold frames of its code.
    delete module;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
    if (module == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
    for (const Entry* entry = module->module->entries; entry->name != nullptr; entry++) {
        if (std::strcmp(entry->name, name) == 0) {
            *function = new CUfunc_st{module->module, entry};
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuFuncSetAttribute(CUfunction, int, int) { return check(); }

CUresult cuFuncGetAttribute(int* value, int, CUfunction) {
    *value = 0;
    return check();
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        CUstream stream, void** parameters, void** extra) {
    return launch(f, Dim{gx, gy, gz}, Dim{bx, by, bz}, shared, stream, parameters, extra, false);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** parameters,
                          void** extra) {
    if (config == nullptr) return CUDA_ERROR_INVALID_VALUE;
    bool dependent = false;
    for (unsigned int i = 0; i < config->numAttrs; i++) {
        // Dependent launches are what the executor asks for: run in order, as every launch is
        // here, with their blocks checked against reading before `wait_for_inputs()`.
        if (config->attrs[i].id != LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) {
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        int allowed = 0;
        std::memcpy(&allowed, config->attrs[i].value, sizeof allowed);
        dependent = allowed != 0;
    }
    return launch(f, Dim{config->gridDimX, config->gridDimY, config->gridDimZ},
                  Dim{config->blockDimX, config->blockDimY, config->blockDimZ},
                  config->sharedMemBytes, config->hStream, parameters, extra, dependent);
}

CUresult cuGetErrorString(CUresult error, const char** text) {
    switch (error) {
        case CUDA_SUCCESS: *text = "no error"; break;
        case CUDA_ERROR_LAUNCH_FAILED:
            *text = "unspecified launch failure (the emulator printed why)";
            break;
        case CUDA_ERROR_INVALID_IMAGE: *text = "device kernel image is invalid"; break;
        default: *text = "an error of the lockstep CUDA emulator"; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** text) { return cuGetErrorString(error, text); }

}  // extern "C"
