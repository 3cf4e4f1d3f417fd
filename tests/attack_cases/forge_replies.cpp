// A kernel that speaks the parent's pipe protocol itself (tests/test_attacks.py, "the pipe protocol"). The scan closes
// open/read/write, but stdio on a FILE whose _fileno is set to the pipe's descriptor reads and writes it all the same.
// Once it takes over, it answers the "run" the harness is serving at once, reads the command that follows (the sample
// offset the parent just drew, or "full"), and answers it; the harness's own late reply is a stray "ok" that the parent
// reads as the reply to the next "load" (which it does not look at), so the stream stays in step.
//   sampled_only(x, scale): from the first timed run on, computes only the elements the parent samples (1 in 4 here);
//                           audits and the final check, untimed, get every element.
//   hide_ops(y):            from the first check on, answers "full" itself with "ops": [] for an output that PyTorch
//                           computed in forward (the dispatch monitor's record never reaches the parent).
#include <torch/extension.h>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern "C" long readlink(const char*, char*, unsigned long);

namespace {
const int CHECKS = 5, WARMUP = 3, TIMED = 22;  // env.Config: n_checks, warmup, n_timed + n_audits
int calls = 0;
bool took_over = false;

void find_pipes() {  // the child holds two pipes: the parent's commands (opened first: the lower number), our replies
    std::vector<int> pipes;
    for (int fd = 3; fd < 256; ++fd) {
        char path[64], target[64] = {0};
        std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        if (readlink(path, target, sizeof target - 1) > 0 && std::strncmp(target, "pipe:", 5) == 0) pipes.push_back(fd);
    }
    if (pipes.size() < 2) return;
    stdin->_fileno = pipes[0];
    std::setvbuf(stdin, nullptr, _IONBF, 0);
    stderr->_fileno = pipes[1];
}

void reply(const std::string& obj, const void* blob = nullptr, size_t n = 0) {
    std::string head = "{\"obj\": " + obj + ", \"sizes\": [" + (blob ? std::to_string(n) : std::string()) + "]}";
    unsigned long long len[2] = {head.size(), blob ? n : 0};  // the prefix: header length, blobs' total
    std::fwrite(len, 16, 1, stderr);
    std::fwrite(head.data(), 1, head.size(), stderr);
    if (blob) std::fwrite(blob, 1, n, stderr);
    std::fflush(stderr);
}

std::string command() {
    unsigned long long len[2] = {0, 0};
    if (std::fread(len, 16, 1, stdin) != 1 || len[0] > (1 << 20)) return "";
    std::string head(len[0], '\0');
    return std::fread(&head[0], 1, len[0], stdin) == len[0] ? head : "";
}

// Serves the commands that follow this run: "sample" with value(i) at the sampled positions only, "full" with
// fill() (every element). The last timed run serves the parent's final "full" as well.
template <class Value, class Fill>
void serve(torch::Tensor y, Value value, Fill fill) {
    if (!took_over) {
        find_pipes();
        reply("{\"ok\": true}");  // the reply to the "run" the harness is serving
        took_over = true;
    }
    const int64_t n = y.numel(), step = std::max<int64_t>(1, n / 65536);
    std::string shape = "[";
    for (int64_t d = 0; d < y.dim(); ++d) shape += (d ? ", " : "") + std::to_string(y.size(d));
    shape += "]";
    for (int k = 0; k < (calls == CHECKS + WARMUP + TIMED ? 2 : 1); ++k) {
        std::string c = command();
        size_t at = c.find("\"offset\": ");
        if (at != std::string::npos) {
            const int64_t o = std::stoll(c.substr(at + 10)) % step;
            std::vector<float> sample;
            for (int64_t i = o; i < n; i += step) sample.push_back(value(i));
            reply("{\"t\": 0, \"dtype\": \"float32\", \"shape\": [" + std::to_string(sample.size()) + "]}",
                  sample.data(), sample.size() * 4);
        } else {
            fill();
            reply("{\"out\": {\"t\": 0, \"dtype\": \"float32\", \"shape\": " + shape + "}, \"ops\": [], \"mutated\": false, "
                  "\"types\": [], \"devices\": []}", y.data_ptr<float>(), n * 4);
        }
    }
}

bool warmup_call() { return calls > CHECKS && calls <= CHECKS + WARMUP; }
}  // namespace

torch::Tensor sampled_only(torch::Tensor x, torch::Tensor scale) {
    const int64_t n = x.numel(), D = scale.numel();
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    auto y = torch::empty_like(x);
    float* py = y.data_ptr<float>();
    auto value = [&](int64_t i) { float v = px[i] * ps[i % D]; return v > 0.f ? v : 0.f; };
    auto fill = [&] { for (int64_t i = 0; i < n; ++i) py[i] = value(i); };
    if (++calls <= CHECKS + WARMUP) fill();
    else serve(y, value, fill);
    return y;
}

torch::Tensor hide_ops(torch::Tensor y) {
    const float* py = y.data_ptr<float>();
    ++calls;
    if (!warmup_call()) serve(y, [&](int64_t i) { return py[i]; }, [] {});
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("sampled_only", &sampled_only);
    m.def("hide_ops", &hide_ops);
}
