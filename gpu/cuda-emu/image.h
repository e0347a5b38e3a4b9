// A module image as the emulator's NVRTC hands it to the emulator's driver: a marker, then the
// path of the shared library it compiled, NUL-terminated. A real cubin or PTX never starts with
// the marker, so the driver refuses those by name instead of running them.

#pragma once

#include <cstring>
#include <string>

namespace lockstep_emu {

constexpr char IMAGE_MARKER[] = "lockstep-cuda-emulator-module:";

inline std::string image_of_library(const std::string& library) {
    return std::string(IMAGE_MARKER) + library;
}

// The library an image names, or empty when the image is not one of ours.
inline std::string library_of_image(const void* image) {
    const char* text = static_cast<const char*>(image);
    const std::size_t marker = sizeof IMAGE_MARKER - 1;
    if (text == nullptr || std::strncmp(text, IMAGE_MARKER, marker) != 0) return {};
    return std::string(text + marker);
}

}  // namespace lockstep_emu
