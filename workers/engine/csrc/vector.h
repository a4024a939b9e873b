/* Vectors of the CPU's own width, shared by both kernels: written for 16-float vectors, on an AVX2 CPU (two
 * registers each) the compiler kept them on the stack and the kernels ran 2-9x slower. */
#include <string.h>

#if defined(__AVX512F__)
#define WIDTH 16
#elif defined(__AVX__)
#define WIDTH 8
#else
#define WIDTH 4   /* NEON, SSE */
#endif
typedef float vec __attribute__((vector_size(WIDTH * sizeof(float))));

static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }
