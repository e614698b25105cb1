/* The native kernels' runtime: what the compiled entries take from numba's runtime when
   they run from the library, without numba in the process (attnkit.kernels.native).

   - their scratch arrays' memory: the layout of numba's MemInfo (numba/core/runtime/nrt.cpp)
     and the functions that allocate and release it;
   - numba's reshape helper (for arrays not known to be contiguous);
   - the spin barrier's yield, the platform's own (POSIX sched_yield, Win32 SwitchToThread);
   - `attnkit_missing`, which the build links every other numba_ / NRT_ symbol the code
     names to (the error paths, which the entries never take): it aborts with a message. */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef _WIN32
#include <windows.h>
#else
#include <sched.h>
#endif

typedef struct {
    size_t refct;
    void (*dtor)(void *, size_t, void *);
    void *dtor_info;
    void *data;
    size_t size;
    void *external_allocator;
} MemInfo;

static void fatal(const char *what) {
    fprintf(stderr, "attnkit native kernels: %s\n", what);
    abort();
}

void attnkit_missing(void) { fatal("a numba runtime function the library lacks was called"); }

int attnkit_yield(void) {
#ifdef _WIN32
    return SwitchToThread() ? 0 : 1;
#else
    return sched_yield();
#endif
}

MemInfo *NRT_MemInfo_alloc_aligned(size_t size, unsigned align) {
    char *base = malloc(sizeof(MemInfo) + size + 2 * (size_t)align);
    if (base == NULL) fatal("out of memory");
    uintptr_t data = (uintptr_t)(base + sizeof(MemInfo));
    if (align > 1 && data % align) data += align - data % align;
    MemInfo *mi = (MemInfo *)base;
    mi->refct = 1;
    mi->dtor = NULL;
    mi->dtor_info = NULL;
    mi->data = (void *)data;
    mi->size = size;
    mi->external_allocator = NULL;
    return mi;
}

void NRT_MemInfo_call_dtor(MemInfo *mi) {
    if (mi->dtor) mi->dtor(mi->data, mi->size, mi->dtor_info);
    free(mi);
}

void NRT_Free(void *ptr) { free(ptr); }

void *NRT_Allocate(size_t size) {
    void *ptr = malloc(size);
    if (ptr == NULL) fatal("out of memory");
    return ptr;
}

/* A reshape without a copy (numba calls it for arrays not known to be contiguous): the
   new strides, or 0 when the data cannot be viewed so. Dimensions of length 1 are dropped;
   then each run of old dimensions whose product matches a run of new ones must be
   contiguous in the given order, and the new run takes its strides from it. */
int numba_attempt_nocopy_reshape(intptr_t nd, const intptr_t *dims, const intptr_t *strides, intptr_t newnd,
                                 const intptr_t *newdims, intptr_t *newstrides, intptr_t itemsize, int is_f_order) {
    intptr_t od[64], os[64], n = 0;
    if (nd > 64) return 0;
    for (intptr_t i = 0; i < nd; i++) {
        if (dims[i] != 1) { od[n] = dims[i]; os[n] = strides[i]; n++; }
    }
    intptr_t oi = 0, oj = 1, ni = 0, nj = 1;
    while (ni < newnd && oi < n) {
        intptr_t a = newdims[ni], b = od[oi];
        while (a != b) {
            if (a < b) { if (nj >= newnd) return 0; a *= newdims[nj++]; }
            else { if (oj >= n) return 0; b *= od[oj++]; }
        }
        for (intptr_t k = oi; k < oj - 1; k++) {
            if (is_f_order ? os[k + 1] != od[k] * os[k] : os[k] != od[k + 1] * os[k + 1]) return 0;
        }
        if (is_f_order) {
            newstrides[ni] = os[oi];
            for (intptr_t k = ni + 1; k < nj; k++) newstrides[k] = newstrides[k - 1] * newdims[k - 1];
        } else {
            newstrides[nj - 1] = os[oj - 1];
            for (intptr_t k = nj - 1; k > ni; k--) newstrides[k - 1] = newstrides[k] * newdims[k];
        }
        ni = nj++;
        oi = oj++;
    }
    intptr_t last = itemsize;
    if (ni > 0) last = is_f_order ? newstrides[ni - 1] * newdims[ni - 1] : newstrides[ni - 1];
    for (intptr_t k = ni; k < newnd; k++) newstrides[k] = last;
    return 1;
}
