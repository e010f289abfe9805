// The llama.cpp peer of `deepinfer bench`: node-llama-cpp's prebuilt llama.cpp on token-id requests.
//
// Usage: node llama_cpp_peer.mjs INSTALL_DIR < job.json
//   INSTALL_DIR  a directory holding node_modules/node-llama-cpp (`npm i -E --prefix INSTALL_DIR node-llama-cpp@3.21.1`)
//   job.json     {model_path, threads, prompts: [[token id, ...], ...], output_lens: [n, ...], parallel, ctx_size}
//                optional: depths [n, ...] (per request, its first n prompt tokens are evaluated untimed
//                first: llama-bench's -d), flash_attention (true / false; absent: llama.cpp's default),
//                draft_model_path and draft_tokens (speculative decoding with a draft model, one sequence)
//
// The GGUF is loaded on the CPU with a prebuilt binary only (never a source build, never a download).
// Every request is fed as its token ids (no tokenization) and generates greedily exactly
// output_lens[i] tokens, EOS included and ignored. `parallel` sequences share one context
// (ctx_size tokens each) and take requests from one queue, so llama.cpp batches their decode
// steps together (like `llama-server -np N`); parallel 1 runs the requests one at a time.
// Only the generation is timed, after the model load and a short warm-up on every sequence.
//
// Prints one JSON line on stdout: {seconds, output_tokens, requests, threads, parallel, ctx_size,
// node_llama_cpp_version, llama_cpp_release, build_type, cpu_variant}; llama.cpp's logs go to stderr.
// `requests` holds, per request in job order, {tokens, prompt_s, decode_s}: the seconds to its first
// token and from its first token to its last (meaningful one sequence at a time, parallel 1).

import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const WARMUP_PROMPT = [1, 2, 3];
const WARMUP_TOKENS = 2;

/** Throw unless `value` is an integer >= `min`, naming the field and the value. */
function checkInt(field, value, min) {
    if (!Number.isInteger(value) || value < min)
        throw new Error(`job field ${field} must be an integer >= ${min}, got ${JSON.stringify(value)}`);
}

/** Check a job's fields; each request must fit in one sequence's context (no context shift). */
function validateJob(job) {
    if (typeof job.model_path !== "string" || job.model_path === "")
        throw new Error(`job field model_path must be a path to a .gguf file, got ${JSON.stringify(job.model_path)}`);
    checkInt("threads", job.threads, 1);
    checkInt("parallel", job.parallel, 1);
    checkInt("ctx_size", job.ctx_size, 1);
    if (!Array.isArray(job.prompts) || !Array.isArray(job.output_lens) || job.prompts.length !== job.output_lens.length)
        throw new Error(`job fields prompts and output_lens must be arrays of the same length, got ` +
            `${job.prompts?.length} and ${job.output_lens?.length}`);
    job.prompts.forEach((prompt, i) => {
        if (!Array.isArray(prompt) || prompt.length === 0)
            throw new Error(`job field prompts[${i}] must be a non-empty array of token ids`);
        prompt.forEach((token, j) => checkInt(`prompts[${i}][${j}]`, token, 0));
        checkInt(`output_lens[${i}]`, job.output_lens[i], 1);
        if (prompt.length + job.output_lens[i] > job.ctx_size)
            throw new Error(`job field ctx_size = ${job.ctx_size} is too small for request ${i}: ` +
                `${prompt.length} prompt + ${job.output_lens[i]} output tokens`);
    });
}

/** node-llama-cpp's module, resolved from INSTALL_DIR/node_modules. */
async function importNodeLlamaCpp(installDir) {
    const require = createRequire(join(installDir, "package.json"));
    let entry;
    try {
        entry = require.resolve("node-llama-cpp");
    } catch {
        throw new Error(`node-llama-cpp is not installed under ${installDir}: ` +
            `run npm i -E --prefix ${installDir} node-llama-cpp@3.21.1`);
    }
    const packageJson = join(installDir, "node_modules", "node-llama-cpp", "package.json");
    const version = JSON.parse(readFileSync(packageJson, "utf8")).version;
    return { lib: await import(pathToFileURL(entry).href), version };
}

/** The CPU variant of ggml this process loaded (e.g. "zen4" for libggml-cpu-zen4.so), if visible. */
function loadedCpuVariant() {
    try {
        const match = readFileSync("/proc/self/maps", "utf8").match(/libggml-cpu-([\w-]+)\.so/);
        return match ? match[1] : null;
    } catch {
        return null;
    }
}

/** Seconds since `start` (a process.hrtime.bigint()). */
function secondsSince(start) {
    return Number(process.hrtime.bigint() - start) / 1e9;
}

/** Greedy generation of exactly `count` tokens after `prompt` on a cleared sequence; EOS does not stop it.
 *  Returns the tokens and the request's timings: prompt_s (to the first token: the prompt's evaluation
 *  and the first sampling) and decode_s (from the first token to the last: count - 1 decode steps). */
async function generate(sequence, prompt, count, depth = 0) {
    await sequence.clearHistory();
    if (depth > 0)  // the context the timed part runs at (llama-bench's -d): evaluated, not timed
        await sequence.evaluateWithoutGeneratingNewTokens(prompt.slice(0, depth));
    let produced = 0;
    const start = process.hrtime.bigint();
    let first = null, last = null;
    const ids = [];
    for await (const token of sequence.evaluate(prompt.slice(depth), { temperature: 0, yieldEogToken: true })) {
        ids.push(token);
        last = process.hrtime.bigint();
        first ??= last;
        produced += 1;
        if (produced === count)
            break;
    }
    return { tokens: produced, prompt_s: Number(first - start) / 1e9, decode_s: Number(last - first) / 1e9, ids };
}

/** Run every request on `sequences`, each sequence taking the next request from a shared queue;
 *  returns each request's generate() result, in request order. */
async function runQueue(sequences, prompts, outputLens, depths = null) {
    let next = 0;
    const requests = new Array(prompts.length);
    const worker = async (sequence) => {
        while (next < prompts.length) {
            const i = next++;
            requests[i] = await generate(sequence, prompts[i], outputLens[i], depths ? depths[i] : 0);
        }
    };
    await Promise.all(sequences.map(worker));
    return requests;
}

/** Load the model, warm up, time the job's requests; returns the result object. */
async function runJob(job, installDir) {
    validateJob(job);
    const { lib, version } = await importNodeLlamaCpp(installDir);
    const llama = await lib.getLlama({
        gpu: false, build: "never", skipDownload: true, usePrebuiltBinaries: true, progressLogs: false,
        maxThreads: job.threads, logLevel: lib.LlamaLogLevel.error,
        logger: (level, message) => process.stderr.write(`llama.cpp ${level}: ${message}\n`),
    });
    try {
        const model = await llama.loadModel({ modelPath: job.model_path, gpuLayers: 0 });
        const contextOptions = {
            contextSize: job.ctx_size, threads: { ideal: job.threads, min: job.threads }, failedCreationRemedy: false,
            ...(typeof job.flash_attention === "boolean" ? { flashAttention: job.flash_attention } : {}),
        };
        const context = await model.createContext({ sequences: job.parallel, ...contextOptions });
        let predictor;
        if (job.draft_model_path) {  // llama.cpp's draft-model speculation (one sequence)
            const draftModel = await llama.loadModel({ modelPath: job.draft_model_path, gpuLayers: 0 });
            const draftContext = await draftModel.createContext(contextOptions);
            predictor = new lib.DraftSequenceTokenPredictor(draftContext.getSequence(),
                { minTokens: 0, maxTokens: job.draft_tokens ?? 16 });
        }
        const sequences = Array.from({ length: job.parallel },
            () => context.getSequence(predictor ? { tokenPredictor: predictor } : {}));
        await runQueue(sequences, sequences.map(() => WARMUP_PROMPT), sequences.map(() => WARMUP_TOKENS));
        const start = process.hrtime.bigint();
        const requests = await runQueue(sequences, job.prompts, job.output_lens, job.depths ?? null);
        const seconds = secondsSince(start);
        return {
            seconds, output_tokens: requests.reduce((sum, r) => sum + r.tokens, 0), requests,
            threads: job.threads, parallel: job.parallel,
            ctx_size: context.contextSize, node_llama_cpp_version: version,
            llama_cpp_release: llama.llamaCppRelease?.release ?? null, build_type: llama.buildType,
            cpu_variant: loadedCpuVariant(), flash_attention: context.flashAttention,
            draft_model_path: job.draft_model_path ?? null,
            tokens: job.return_tokens ? requests.map((r) => r.ids) : undefined,
        };
    } finally {
        await llama.dispose();
    }
}

async function main() {
    const installDir = process.argv[2];
    if (!installDir)
        throw new Error("usage: node llama_cpp_peer.mjs INSTALL_DIR < job.json");
    const job = JSON.parse(readFileSync(0, "utf8"));
    const result = await runJob(job, installDir);
    process.stdout.write(JSON.stringify(result) + "\n");
}

main().catch((error) => {
    process.stderr.write(`llama_cpp_peer: ${error?.stack ?? error}\n`);
    process.exit(1);
});
