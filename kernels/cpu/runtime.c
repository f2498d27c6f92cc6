/* What the Python side asks the library about itself. */
#include <omp.h>

/* The OpenMP threads a kernel's parallel region gets: equals torch.get_num_threads() when the
 * library shares torch's OpenMP runtime (the build links torch's libgomp). */
int ae_omp_max_threads(void) { return omp_get_max_threads(); }

/* Which SIMD path the build took (the macros -march=native defined). */
int ae_simd_level(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}
