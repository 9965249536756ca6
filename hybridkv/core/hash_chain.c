/* The chained block keys of core/hashing.py for a run of blocks in one call:
 *
 *     key[i] = SHA-256(key[i - 1] || bytes of block i),  key[-1] = parent
 *
 * In Python each key costs about 0.7 us, nearly all of it the interpreter
 * and hashlib's object handling around a ~0.1 us hash; a prompt has dozens
 * of new blocks. SHA-256 itself is not written here: the caller binds the
 * SHA256_Init/Update/Final of the libcrypto that Python's hashlib uses
 * (SHA-NI where the CPU has it), so no OpenSSL header or link step is
 * needed, and the keys are those hashlib gives (hashing.py checks one chain
 * against hashlib before using this library).
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*sha256_init_fn)(void *context);
typedef int (*sha256_update_fn)(void *context, const void *data, size_t length);
typedef int (*sha256_final_fn)(unsigned char *digest, void *context);

#define KEY_BYTES 32

/* OpenSSL's SHA256_CTX is 112 bytes; the buffer leaves room for any layout. */
typedef union {
    uint64_t words[64];
    long double align;
} sha256_context;

static sha256_init_fn sha_init;
static sha256_update_fn sha_update;
static sha256_final_fn sha_final;

/* The libcrypto functions every later chain calls (once per process). */
void hk_sha256_bind(void *init, void *update, void *final)
{
    sha_init = (sha256_init_fn)init;
    sha_update = (sha256_update_fn)update;
    sha_final = (sha256_final_fn)final;
}

/* Writes `count` keys of KEY_BYTES to `out`, block i being
 * data[offset + i * block_bytes, offset + (i + 1) * block_bytes).
 * Returns 0, or -1 if libcrypto reported a failure or nothing is bound
 * (out is then partial). */
int64_t hk_sha256_chain(const unsigned char *parent, const unsigned char *data, int64_t offset,
                        int64_t block_bytes, int64_t count, unsigned char *out)
{
    sha256_context context;
    const unsigned char *block = data + offset;
    if (!sha_init || !sha_update || !sha_final)
        return -1;
    for (int64_t i = 0; i < count; i++, block += block_bytes) {
        unsigned char *key = out + i * KEY_BYTES;
        if (sha_init(&context) != 1 || sha_update(&context, parent, KEY_BYTES) != 1 ||
            sha_update(&context, block, (size_t)block_bytes) != 1 || sha_final(key, &context) != 1)
            return -1;
        parent = key;
    }
    return 0;
}
