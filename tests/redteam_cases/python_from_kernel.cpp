// tests/test_redteam.py (12, 13, 14): kernels that pass the scan and reach the harness's Python.
// (12) relu_sampled is written against the exchange whose positions the child is told ("sample"): it steals the
// nonce of the "run" it is serving, answers that run itself (the native clock then sends the sample command while the
// kernel is still inside forward), reads the sampled offset, computes only the sampled elements (1 in 64 here) and
// answers the sample itself. The harness's own late "ok" for the run, which would put every later reply out of step,
// is absorbed as a trailing, unused blob of the sample (or "full") reply: its length is known (76 bytes), so the
// stream is back in step when the kernel returns. Audits ("full") get the whole output; so does the last timed run,
// which the parent reads in full afterwards (the timed loop is counted from the warmup: 3 runs on one input set;
// checks get fresh inputs each). Where the parent reads the outputs itself, no sample command comes, and the
// harness's reply is out of step. relu_strided is what is left then; relu_full is the honest kernel.
//
// The nonce: the Python C API through function pointers read from this module's own GOT (found from __ehdr_start, a
// linker symbol: no import, no banned token), then sys._getframe() and the harness frame's f_locals.
#include "takeover.h"

namespace {

const int WARMUP = 3, TIMED = 22;  // env.Config: warmup, n_timed + n_audits
int calls = 0, streak = 0, timed_from = 1 << 30;  // the timed loop starts after WARMUP runs on one input set
float last_seen = 0.f;
const int RUN_OK = 76;  // the harness's own reply to "run": 16-byte prefix + {"obj": {"ok": true}, ... "re": nonce}

void put(int fd, const std::string& head, const void* blob, size_t n, size_t trailing) {
    int& f = *reinterpret_cast<int*>(reinterpret_cast<char*>(stderr) + 112);  // stderr's descriptor field
    int mine = f;
    f = fd;
    unsigned long long len[2] = {head.size(), n + trailing};
    std::fwrite(len, 16, 1, stderr);
    std::fwrite(head.data(), 1, head.size(), stderr);
    if (n) std::fwrite(blob, 1, n, stderr);
    std::fflush(stderr);
    f = mine;
}

std::string command(O os, O fd) {  // one whole command, read from the command pipe before the harness sees it
    O data = call(ga(os, "read"), fd, call(getitem(bltn(), s("int")), s("65536"), nullptr), nullptr);
    O str = call(ga(data, "decode"), s("latin-1"), nullptr);
    return text(str).substr(16);
}

std::string field(const std::string& c, const std::string& key) {
    size_t at = c.find("\"" + key + "\": ");
    if (at == std::string::npos) return "";
    at += key.size() + 4;
    if (c[at] == '"') return c.substr(at + 1, c.find('"', at + 1) - at - 1);
    return c.substr(at, c.find_first_of(",}", at) - at);
}
}  // namespace

torch::Tensor relu_sampled(torch::Tensor x, torch::Tensor scale) {
    const int64_t n = x.numel(), D = scale.numel();
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    auto y = torch::empty_like(x);
    float* py = y.data_ptr<float>();
    auto value = [&](int64_t i) { float v = px[i] * ps[i % D]; return v > 0.f ? v : 0.f; };
    auto fill = [&] { for (int64_t i = 0; i < n; ++i) py[i] = value(i); };
    ++calls;
    float seen = 0.f;
    for (int64_t i = 0; i < 64 && i < n; ++i) seen += px[i] * (i + 1);
    streak = seen == last_seen ? streak + 1 : 1;
    last_seen = seen;
    if (streak == WARMUP && timed_from > calls) timed_from = calls;  // the last warmup run (checks: fresh inputs each)
    if (calls <= timed_from) { fill(); return y; }

    O f = harness_frame();
    O locals = ga(f, "f_locals");
    std::string nonce = text(getitem(locals, s("nonce")));
    int rep = std::stoi(text(call(getitem(bltn(), s("str")), getitem(locals, s("rep_fd")), nullptr)));
    O os = call(getitem(bltn(), s("__import__")), s("os"), nullptr);
    O cmd_fd = getitem(locals, s("cmd_fd"));

    put(rep, "{\"obj\": {\"ok\": true}, \"sizes\": [], \"re\": \"" + nonce + "\"}", nullptr, 0, 0);  // the run's reply
    std::string c = command(os, cmd_fd);  // the parent's next command: "sample" (timed) or "full" (an audit)
    std::string re = field(c, "nonce");
    if (field(c, "op") == "sample") {
        const int64_t step = std::max<int64_t>(1, n / 65536), o = std::stoll(field(c, "offset")) % step;
        if (calls == timed_from + TIMED) fill();  // the parent reads the last run in full afterwards
        std::string sample;
        for (int64_t i = o; i < n; i += step) { float v = value(i); sample.append((char*)&v, 4); }  // y itself untouched
        const size_t m = sample.size() / 4;
        put(rep, "{\"obj\": {\"t\": 0, \"dtype\": \"float32\", \"shape\": [" + std::to_string(m) + "]}, \"sizes\": [" +
                 std::to_string(4 * m) + ", " + std::to_string(RUN_OK) + "], \"re\": \"" + re + "\"}",
            sample.data(), sample.size(), RUN_OK);
    } else {
        fill();
        std::string shape = "[" + std::to_string(x.size(0)) + ", " + std::to_string(x.size(1)) + "]";
        put(rep, "{\"obj\": {\"out\": {\"t\": 0, \"dtype\": \"float32\", \"shape\": " + shape + "}, \"ops\": [], "
                 "\"mutated\": false, \"types\": [], \"devices\": []}, \"sizes\": [" + std::to_string(4 * n) + ", " +
                 std::to_string(RUN_OK) + "], \"re\": \"" + re + "\"}", py, 4 * n, RUN_OK);
    }
    clear();
    return y;  // the harness now writes its own "ok" (76 bytes): the last blob of the reply above
}

// (12) relu_strided: what is left once the positions are never told: the same 1 in 64 elements, at a fixed offset, the
// rest left zero, with the harness answering for itself (on checks, the warmup and the last timed run: everything).
torch::Tensor relu_strided(torch::Tensor x, torch::Tensor scale) {
    const int64_t n = x.numel(), D = scale.numel();
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    auto y = torch::zeros_like(x);
    float* py = y.data_ptr<float>();
    ++calls;
    float seen = 0.f;
    for (int64_t i = 0; i < 64 && i < n; ++i) seen += px[i] * (i + 1);
    streak = seen == last_seen ? streak + 1 : 1;
    last_seen = seen;
    if (streak == WARMUP && timed_from > calls) timed_from = calls;
    const bool all = calls <= timed_from || calls == timed_from + TIMED;
    for (int64_t i = 0; i < n; i += all ? 1 : 64) { float v = px[i] * ps[i % D]; py[i] = v > 0.f ? v : 0.f; }
    return y;
}

torch::Tensor relu_full(torch::Tensor x, torch::Tensor scale) {  // the honest kernel, for comparison
    const int64_t n = x.numel(), D = scale.numel();
    const float *px = x.data_ptr<float>(), *ps = scale.data_ptr<float>();
    auto y = torch::empty_like(x);
    float* py = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) { float v = px[i] * ps[i % D]; py[i] = v > 0.f ? v : 0.f; }
    return y;
}

// (14) relu_precomputed: the whole output computed whenever the harness answers a command other than "run" (a
// "load", a "flush", anything the parent sends between runs), none of which is timed. The kernel exec()s a few lines of
// Python that wrap `send` in _child_main's globals: before the harness answers such a command, the wrapper calls
// cuda_extension.precompute(buffers[0]), which keeps the output and a fingerprint of the input it came from; a "run"
// whose input has that fingerprint returns the kept output at once (any other computes honestly). Where the child is
// told each run's input before the run ("load"), every element is right (checks, reads, audits) and none of the work
// is inside [t0, t1]; where the parent writes the input just before the clock starts, no precomputed output matches.
const char* PRECOMPUTE_HOOK =
    "import sys\n"
    "f = sys._getframe()\n"
    "while f is not None and f.f_code.co_name != '_child_main':\n"
    "    f = f.f_back\n"
    "g, ext = f.f_globals, sys.modules['cuda_extension']\n"
    "orig = g['send']\n"
    "def send(fd, obj, blobs=(), re=None, deadline=None):\n"
    "    L = sys._getframe(1).f_locals\n"
    "    c, b = L.get('cmd'), L.get('buffers')\n"
    "    if isinstance(c, dict) and c.get('op') != 'run' and b and hasattr(b[0], 'shape'):\n"
    "        ext.precompute(b[0])\n"
    "    return orig(fd, obj, blobs, re=re, deadline=deadline)\n"
    "g['send'] = send\n";
torch::Tensor pre, pre_scale;
std::vector<float> pre_print;
bool hooked = false;

std::vector<float> fingerprint(const torch::Tensor& x) {  // 64 elements spread over the input
    const int64_t n = x.numel();
    const float* px = x.data_ptr<float>();
    std::vector<float> v;
    for (int64_t i = 0; i < 64 && n; ++i) v.push_back(px[(i * 2654435761LL) % n]);
    return v;
}

torch::Tensor precompute(torch::Tensor x) {
    if (pre_scale.defined() && x.dim() == 2 && x.size(1) == pre_scale.numel()) {
        pre = relu_full(x, pre_scale);
        pre_print = fingerprint(x);
    }
    return x.new_empty({0});
}

torch::Tensor relu_precomputed(torch::Tensor x, torch::Tensor scale) {
    pre_scale = scale;
    if (!hooked) {
        hooked = true;
        harness_frame();  // (resolves the Python API)
        call(getitem(bltn(), s("exec")), s(PRECOMPUTE_HOOK), call(getitem(bltn(), s("dict")), nullptr), nullptr);
        clear();
    }
    if (pre.defined() && pre.sizes() == x.sizes() && fingerprint(x) == pre_print) return pre;
    return relu_full(x, scale);
}

// (13) The command pipe, reopened for writing through /proc/self/fd and filled, then the run answered and sleep: the
// parent's next command (in a verify, "full") finds the pipe full; with no deadline on writes it blocked until the
// verdict's wall clock killed the child, holding the device all that time.
torch::Tensor fill_and_stall(torch::Tensor x, torch::Tensor scale) {
    O f = harness_frame();
    O locals = ga(f, "f_locals");
    std::string nonce = text(getitem(locals, s("nonce")));
    O str_ = getitem(bltn(), s("str"));
    O int_ = getitem(bltn(), s("int"));
    int rep = std::stoi(text(call(str_, getitem(locals, s("rep_fd")), nullptr)));
    std::string cmd = text(call(str_, getitem(locals, s("cmd_fd")), nullptr));
    O os = call(getitem(bltn(), s("__import__")), s("os"), nullptr);
    O path = s(("/proc/self/fd/" + cmd).c_str());
    O w = call(ga(os, "open"), path, call(int_, s("2049"), nullptr), nullptr);  // O_WRONLY | O_NONBLOCK
    if (w) {
        O junk = call(ga(s(std::string(4096, ' ').c_str()), "encode"), nullptr);
        for (int i = 0; i < 1024; ++i) if (!call(ga(os, "write"), w, junk, nullptr)) break;  // until EAGAIN: full
    }
    clear();
    put(rep, "{\"obj\": {\"ok\": true}, \"sizes\": [], \"re\": \"" + nonce + "\"}", nullptr, 0, 0);
    timespec t{1000, 0};
    for (;;) nanosleep(&t, nullptr);
    return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("relu_sampled", &relu_sampled);
    m.def("relu_strided", &relu_strided);
    m.def("relu_full", &relu_full);
    m.def("fill_and_stall", &fill_and_stall);
    m.def("precompute", &precompute);
    m.def("relu_precomputed", &relu_precomputed);
}
