// NVRTC as far as the CUDA executor calls it, compiling a kernel source with the host's C++
// compiler into a shared library the emulator's driver runs (driver.cpp): the source after
// device.h, then a table of its `extern "C" __global__` functions (every entry point is
// declared so; gpu/src/cuda/kernels.rs tests it). Supports one architecture, sm_90, so the
// executor asks for a cubin and takes the sm_90 paths.
//
// Libraries are cached by a hash of everything that goes into them (source, headers, compiler
// and flags) under $LOCKSTEP_CUDA_EMU_CACHE (default: a folder in $TMPDIR): a test run compiles
// each module once. The compiler is $LOCKSTEP_CUDA_EMU_CXX, else `c++`. What it prints is the
// program log; a warning fails the executor's `compile_clean` as NVRTC's would.

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "image.h"

namespace {

typedef int nvrtcResult;
enum : nvrtcResult {
    NVRTC_SUCCESS = 0,
    NVRTC_ERROR_OUT_OF_MEMORY = 1,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_INVALID_OPTION = 5,
    NVRTC_ERROR_COMPILATION = 6,
};

constexpr int ARCHITECTURE = 90;

struct Program {
    std::string source;
    std::string name;
    std::string log;
    std::string image;  // NUL-terminated when set
};

// This library's folder: device.h and runtime.h sit beside it (gpu/cuda-emu/build.sh).
std::string own_folder() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&own_folder), &info) == 0 || info.dli_fname == nullptr) {
        return ".";
    }
    std::string path = info.dli_fname;
    const std::size_t slash = path.rfind('/');
    return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

std::uint64_t fnv1a(const std::string& text, std::uint64_t hash = 0xcbf29ce484222325ull) {
    for (unsigned char c : text) {
        hash ^= c;
        hash *= 0x100000001b3ull;
    }
    return hash;
}

std::string cache_folder() {
    if (const char* set = std::getenv("LOCKSTEP_CUDA_EMU_CACHE"); set != nullptr && *set) {
        return set;
    }
    const char* tmp = std::getenv("TMPDIR");
    return std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/lockstep-cuda-emu-" +
           std::to_string(getuid());
}

// The source as the host compiler gets it: device.h, the kernel source under its own name (so
// diagnostics name the .cu file and its lines), and the entry table.
std::string translation_unit(const Program& program) {
    std::string unit = "#include \"device.h\"\n#line 1 \"" + program.name + "\"\n";
    unit += program.source;
    unit += "\n// The emulator's entry table (nvrtc.cpp).\n";
    unit += "static const lockstep_emu::Entry lockstep_emu_entries[] = {\n";
    static const std::regex entry(R"(extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\()");
    for (auto it = std::sregex_iterator(program.source.begin(), program.source.end(), entry);
         it != std::sregex_iterator(); ++it) {
        unit += "    LOCKSTEP_EMU_ENTRY(" + (*it)[1].str() + "),\n";
    }
    unit += "    lockstep_emu::Entry{nullptr, nullptr, 0, {}, 0},\n};\n";
    unit += "static lockstep_emu::Coordinates* lockstep_emu_coordinates() {\n"
            "    return &lockstep_emu_device::coordinates;\n}\n"
            "extern \"C\" __attribute__((visibility(\"default\")))\n"
            "const lockstep_emu::Module lockstep_emu_module = {\n"
            "    lockstep_emu_entries, &lockstep_emu_device::runtime, lockstep_emu_coordinates};\n";
    return unit;
}

// Kernels reach threadIdx and `__shared__` through thread-locals (device.h); in a module loaded
// by dlopen each such touch is a call to `__tls_get_addr` unless it uses TLS descriptors
// (aarch64's default).
#if defined(__x86_64__)
#define TLS_DESCRIPTORS " -mtls-dialect=gnu2"
#else
#define TLS_DESCRIPTORS ""
#endif

// Runs `command`, its stdout and stderr into `log`; whether it exited 0.
bool run(const std::string& command, std::string& log) {
    FILE* pipe = popen((command + " 2>&1").c_str(), "r");
    if (pipe == nullptr) {
        log = "could not start: " + command;
        return false;
    }
    char buffer[4096];
    std::size_t n;
    while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) log.append(buffer, n);
    return pclose(pipe) == 0;
}

nvrtcResult compile(Program& program, const std::vector<std::string>& options) {
    for (const std::string& option : options) {
        const std::string arch = "--gpu-architecture=";
        if (option.rfind(arch, 0) == 0 && option != arch + "sm_" + std::to_string(ARCHITECTURE) &&
            option != arch + "compute_" + std::to_string(ARCHITECTURE)) {
            program.log = "the emulator compiles for sm_90 only, not " + option;
            return NVRTC_ERROR_INVALID_OPTION;
        }
    }
    const std::string folder = own_folder();
    const char* cxx_set = std::getenv("LOCKSTEP_CUDA_EMU_CXX");
    const std::string cxx = cxx_set != nullptr && *cxx_set ? cxx_set : "c++";
    // -O2 for speed; no fused multiply-add where the source wrote none (fmaf is explicit);
    // every symbol hidden but the module table, so that a kernel named like a libc function
    // (`write`) is the kernel, not the process's function of that name. CUDA C compares
    // `threadIdx.x` with ints everywhere: no warning for it, as NVRTC gives none.
    const std::string flags =
        "-std=c++17 -O2 -fPIC -shared -fvisibility=hidden -ffp-contract=off -Wall "
        "-Wno-unknown-pragmas -Wno-sign-compare -Wno-unused-function -x c++" TLS_DESCRIPTORS;
    const std::string unit = translation_unit(program);
    std::string version_log;
    run(cxx + " --version", version_log);
    const std::uint64_t key = fnv1a(unit + read_file(folder + "/device.h") +
                                    read_file(folder + "/runtime.h") + cxx + flags + version_log);
    char name[32];
    std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(key));
    const std::string cache = cache_folder();
    mkdir(cache.c_str(), 0700);
    const std::string library = cache + "/" + program.name + "." + name + ".so";
    const std::string log_file = library + ".log";
    if (access(library.c_str(), R_OK) != 0) {
        static std::atomic<unsigned> counter{0};
        const std::string part = library + ".part" + std::to_string(getpid()) + "." +
                                 std::to_string(counter++);
        const std::string source = part + ".cu";
        std::ofstream(source, std::ios::binary) << unit;
        std::string log;
        const bool built = run(cxx + " " + flags + " -I'" + folder + "' '" + source + "' -o '" +
                                   part + "'",
                               log);
        std::remove(source.c_str());
        if (!built) {
            std::remove(part.c_str());
            program.log = log;
            return NVRTC_ERROR_COMPILATION;
        }
        std::ofstream(log_file + ".part", std::ios::binary) << log;
        std::rename((log_file + ".part").c_str(), log_file.c_str());
        std::rename(part.c_str(), library.c_str());
    }
    program.log = read_file(log_file);
    program.image = lockstep_emu::image_of_library(library);
    program.image.push_back('\0');
    return NVRTC_SUCCESS;
}

// Copies `text` and its NUL out, as NVRTC's getters do.
nvrtcResult copy_out(const std::string& text, char* out) {
    if (out == nullptr) return NVRTC_ERROR_INVALID_INPUT;
    std::memcpy(out, text.c_str(), text.size() + 1);
    return NVRTC_SUCCESS;
}

}  // namespace

typedef Program* nvrtcProgram;

extern "C" {

const char* nvrtcGetErrorString(nvrtcResult result) {
    switch (result) {
        case NVRTC_SUCCESS: return "NVRTC_SUCCESS";
        case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
        case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
        case NVRTC_ERROR_INVALID_OPTION: return "NVRTC_ERROR_INVALID_OPTION";
        case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION";
        default: return "NVRTC_ERROR (lockstep CUDA emulator)";
    }
}

nvrtcResult nvrtcVersion(int* major, int* minor) {
    *major = 12;
    *minor = 8;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetNumSupportedArchs(int* count) {
    *count = 1;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetSupportedArchs(int* archs) {
    archs[0] = ARCHITECTURE;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCreateProgram(nvrtcProgram* program, const char* source, const char* name,
                               int headers, const char* const*, const char* const*) {
    if (program == nullptr || source == nullptr) return NVRTC_ERROR_INVALID_INPUT;
    // Our sources include nothing: headers would be a program this emulator does not know.
    if (headers != 0) return NVRTC_ERROR_INVALID_INPUT;
    *program = new Program{source, name != nullptr ? name : "program.cu", {}, {}};
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcDestroyProgram(nvrtcProgram* program) {
    if (program == nullptr) return NVRTC_ERROR_INVALID_PROGRAM;
    delete *program;
    *program = nullptr;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCompileProgram(nvrtcProgram program, int count, const char* const* options) {
    if (program == nullptr) return NVRTC_ERROR_INVALID_PROGRAM;
    std::vector<std::string> list;
    for (int i = 0; i < count; i++) list.emplace_back(options[i]);
    return compile(*program, list);
}

nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram program, std::size_t* size) {
    if (program == nullptr) return NVRTC_ERROR_INVALID_PROGRAM;
    *size = program->log.size() + 1;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetProgramLog(nvrtcProgram program, char* log) {
    if (program == nullptr) return NVRTC_ERROR_INVALID_PROGRAM;
    return copy_out(program->log, log);
}

nvrtcResult nvrtcGetCUBINSize(nvrtcProgram program, std::size_t* size) {
    if (program == nullptr || program->image.empty()) return NVRTC_ERROR_INVALID_PROGRAM;
    *size = program->image.size();
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetCUBIN(nvrtcProgram program, char* cubin) {
    if (program == nullptr || program->image.empty() || cubin == nullptr) {
        return NVRTC_ERROR_INVALID_PROGRAM;
    }
    std::memcpy(cubin, program->image.data(), program->image.size());
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetPTXSize(nvrtcProgram program, std::size_t* size) {
    return nvrtcGetCUBINSize(program, size);
}

nvrtcResult nvrtcGetPTX(nvrtcProgram program, char* ptx) { return nvrtcGetCUBIN(program, ptx); }

}  // extern "C"
