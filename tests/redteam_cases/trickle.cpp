// tests/test_redteam.py, "a reply sent byte by byte": a kernel that never returns but keeps the reply pipe from idling.
#include <torch/extension.h>
#include <cstdio>

// Writes to the reply pipe without naming a FILE field: _fileno is at offset 112 of glibc's FILE (x86_64).
static int& fileno_of(FILE* f) { return *reinterpret_cast<int*>(reinterpret_cast<char*>(f) + 112); }

torch::Tensor trickle(torch::Tensor x) {
    unsigned long long len[2] = {(1ull << 20) - 1, 0};  // a header the parent will wait for, byte by byte; no blobs
    int mine = fileno_of(stderr);
    int found = -1;
    for (int fd = 3; fd < 1024 && found < 0; ++fd) {
        fileno_of(stderr) = fd;
        if (std::fwrite(len, 16, 1, stderr) == 1 && std::fflush(stderr) == 0) found = fd;
    }
    if (found < 0) { fileno_of(stderr) = mine; std::fputs("no pipe found\n", stderr); return x; }
    timespec t{0, 200 * 1000 * 1000};
    for (;;) {  // one blank of JSON every 0.2 s: the parent's select never idles for 0.5 s
        std::fputc(' ', stderr);
        std::fflush(stderr);
        nanosleep(&t, nullptr);
    }
    return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("trickle", &trickle); }
