// tests/redteam_cases/takeover.h: how the kernels of tests/test_redteam.py 12-15 reach the harness's Python. The
// Python C API through function pointers read from the module's own GOT (found from __ehdr_start, a linker
// symbol: no import, no banned token), then sys._getframe() and the harness frame (protocol._child_main).
#include <torch/extension.h>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

extern "C" char __ehdr_start;

namespace {
typedef void* O;  // a Python object
struct Dyn { long long tag; unsigned long long val; };
struct Rela { unsigned long long off, info; long long add; };
struct Sym { unsigned name; unsigned char info, other; unsigned short shndx; unsigned long long value, size; };
struct Phdr { unsigned type, flags; unsigned long long off, vaddr, paddr, filesz, memsz, align; };

void* got(const char* want) {  // the resolved address of an imported function, from our own relocations
    char* base = &__ehdr_start;
    unsigned long long phoff = *reinterpret_cast<unsigned long long*>(base + 32);
    unsigned short phnum = *reinterpret_cast<unsigned short*>(base + 56);
    Phdr* ph = reinterpret_cast<Phdr*>(base + phoff);
    Dyn* dyn = nullptr;
    for (int i = 0; i < phnum; ++i) if (ph[i].type == 2) dyn = reinterpret_cast<Dyn*>(base + ph[i].vaddr);
    auto at = [&](unsigned long long v) { return v < (unsigned long long)base ? base + v : reinterpret_cast<char*>(v); };
    Sym* syms = nullptr; char* strs = nullptr; Rela* rel[2] = {nullptr, nullptr}; unsigned long long sz[2] = {0, 0};
    for (Dyn* d = dyn; d->tag; ++d) {
        if (d->tag == 6) syms = reinterpret_cast<Sym*>(at(d->val));
        if (d->tag == 5) strs = at(d->val);
        if (d->tag == 7) rel[0] = reinterpret_cast<Rela*>(at(d->val));
        if (d->tag == 8) sz[0] = d->val;
        if (d->tag == 23) rel[1] = reinterpret_cast<Rela*>(at(d->val));
        if (d->tag == 2) sz[1] = d->val;
    }
    for (int k = 0; k < 2; ++k)
        for (unsigned long long i = 0; rel[k] && i < sz[k] / sizeof(Rela); ++i) {
            unsigned s = rel[k][i].info >> 32;
            if (s && std::strcmp(strs + syms[s].name, want) == 0) return *reinterpret_cast<void**>(base + rel[k][i].off);
        }
    return nullptr;
}

O (*bltn)();
O (*getitem)(O, O);
O (*ustr)(const char*);
O (*call)(O, ...);
O (*ga)(O, const char*);
const char* (*utf8)(O, long*);
void (*clear)();

O s(const char* v) { return ustr(v); }
std::string text(O o) { long n = 0; const char* p = utf8(o, &n); return std::string(p, n); }

O harness_frame() {  // the frame of protocol._child_main, whose locals hold the nonce being served
    if (!bltn) {
        bltn = (O(*)())got("PyEval_GetBuiltins");
        getitem = (O(*)(O, O))got("PyObject_GetItem");
        ustr = (O(*)(const char*))got("PyUnicode_FromString");
        call = (O(*)(O, ...))got("PyObject_CallFunctionObjArgs");
        ga = (O(*)(O, const char*))got("PyObject_GetAttrString");
        utf8 = (const char* (*)(O, long*))got("PyUnicode_AsUTF8AndSize");
        clear = (void (*)())got("PyErr_Clear");
    }
    O sys = call(getitem(bltn(), s("__import__")), s("sys"), nullptr);
    O f = call(ga(sys, "_getframe"), nullptr);
    while (f && text(ga(ga(f, "f_code"), "co_name")) != "_child_main") f = ga(f, "f_back");
    return f;
}
}  // namespace
