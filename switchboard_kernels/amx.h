/* AMX tiles for the native kernels (Intel Xeons since Sapphire Rapids): the OS's permission
 * and one tile configuration. Defines SB_AMX where the compiler targets AMX-BF16. */
#ifndef SWITCHBOARD_AMX_H
#define SWITCHBOARD_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SB_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of every tile */
#define AMX_K 32    /* bf16 in a tile's row: 64 bytes */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux lends the tile registers to a process that asks (once; oneDNN asks too). Call it
 * outside parallel regions: the first call sets the answer. */
static inline int amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* This thread's eight tiles, each 16 rows of 64 bytes: fp32 sums 16 x 16, bf16 rows 16 x 32,
 * or 16 pairs (VNNI) of 16 columns. Release them with _tile_release() when done. */
static inline void amx_configure(void) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&c);
}
#endif

#endif /* SWITCHBOARD_AMX_H */
