// The C parameter blocks native.py fills (its _Params and _GradParams mirror them field for
// field; js_abi_version in attention.cpp changes with them).
//
// Part of attention.cpp, which includes its parts in order as one translation unit (the
// compiler inlines across them); not compiled on its own.
#pragma once

extern "C" {

// Mirrored field for field by _Params in native.py.
struct JsParams {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;              // may be null
    const int32_t* cu_q;       // (batch + 1,) query offsets into q/out
    const int32_t* cu_k;       // (batch + 1,) key offsets into k/v
    const int32_t* seqused_k;  // (batch,) keys each sequence uses from its start, or null
    // A paged KV cache: k/v are (num_blocks, block_size, Hkv, D) with a block stride
    // k_block/v_block, key j of sequence b lives in block block_table[b * bt_stride + j / block_size];
    // cu_k is then null and seqused_k gives the lengths.
    const int32_t* block_table;
    int64_t bt_stride, block_size, k_block, v_block;
    const float* slopes;     // ALiBi slopes, null when off
    int64_t slopes_batch_stride;  // 0 for (Hq,), Hq for (B, Hq)
    int64_t batch, heads_q, heads_kv, head_dim, head_dim_v;
    int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok, o_head;
    int64_t lse_head, lse_tok;
    float scale, softcap;
    int32_t causal, bottom_right;
    int64_t window_left, window_right;
    int32_t dtype;           // 0 float32, 1 float16, 2 bfloat16; k/v fp8 (q and out float32): 3 e4m3fn, 4 e5m2
    int32_t threads;
    // Work split (tests shrink them to reach every path on small shapes): query rows per item
    // (capped by chunk_rows), sequences with at most direct_rows queries run as direct rows, whose keys
    // go in steps of direct_keys (at most DIRECT_KEYS).
    int32_t q_chunk, direct_rows, direct_keys;
    // Dropout (keyed_dropout.py): the call's key and p in [0, 1); p = 0 is off.
    uint32_t dropout_seed, dropout_offset;
    float dropout_p;
    // docs/api.md section 11: chunked attention (chunk_size C, 0 = off), prefix-LM (prefix_lens (batch,), null =
    // off) and sinks ((Hq,) float32 logits, null = off).
    int64_t chunk_size;
    const int32_t* prefix_lens;
    const float* sinks;
    // A dense cache read in place (docs/api.md section 12) is a paged cache of one block of S slots per sequence
    // (block_table[b] = b, block_size = S): sequence b's keys start at slot cache_leftpad[b] of its
    // block (null: at 0).
    const int32_t* cache_leftpad;
};

// The backward's tensors beside the forward's (whose out is read here): dout (total_q, Hq, Dv),
// dq like q, dk like k, dv like v (any token and head strides, contiguous last dim; with a paged
// cache dk/dv are cache-shaped with block strides dk_block/dv_block), lse as written by the
// forward. dq/dk/dv arrive zeroed; the kernel writes every row some sequence reads. dsinks (Hq,)
// float32 gets the sinks' gradient (null: not wanted).
struct JsGradParams {
    JsParams f;
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    int64_t do_tok, do_head, dq_tok, dq_head, dk_tok, dk_head, dv_tok, dv_head;
    int64_t dk_block, dv_block;
    float* dsinks;
};

}  // extern "C"
