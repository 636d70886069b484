"""Tests mirror modules: every module of ours has a test file of its own name
(``tests/test_<module>.py``), or is listed here with the test file that covers it and why. No
services, no models: a fraction of a second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "coordinator", "draft_service", "verify_service", "specdec_app")
# Modules without a test of their own name, with the test that covers them.
COVERED_BY = {
    "coordinator/api/auth.py": "test_http_api.py",  # API keys on the HTTP API (and test_secure_default.py)
    "coordinator/api/body_limit.py": "test_limits.py",  # a body over the limit is 413, chunked or not
    "coordinator/api/client.py": "test_resume.py",  # the public client of Generate, its resume
    "coordinator/api/openai_schema.py": "test_http_api.py",  # the OpenAI API's schema, fuzzed by schemathesis
    "coordinator/api/output.py": "test_openai_logprobs.py",  # stream output and log-probabilities
    "coordinator/service.py": "test_e2e_real.py",  # the coordinator end to end on the real models
    "coordinator/api/grpc_auth.py": "test_grpc_edge.py",  # keys before the message, its deadline, the calls bound
    "coordinator/request_store/redis_client.py": "test_store.py",  # every store test on one Redis and on a cluster
    "coordinator/speculation/plan.py": "test_draft_client.py",  # which resolved requests use the draft service
    "coordinator/speculation/policy/k_policy.py": "test_greedy_equality.py",  # a random policy through the contract
    "draft_service/drafters/contract.py": "test_draft_service.py",  # every drafter through the service
    "draft_service/drafters/grammar_vocabulary.py": "test_structured_output.py",  # the draft masked as the target
    "draft_service/drafters/llama_cpp.py": "test_llama_batched.py",
    "draft_service/drafters/transformers_lm.py": "test_draft_service.py",
    "draft_service/service.py": "test_draft_service.py",
    "specdec/__main__.py": "test_bench.py",  # `python -m specdec bench`
    "specdec/engine/batching.py": "test_engine.py",
    "specdec/rpc/decoding.py": "test_fuzz.py",  # undecodable bytes get INVALID_ARGUMENT
    "specdec/rpc/aio_handlers.py": "test_grpc_edge.py",  # a health Watch through the interceptors
    "specdec/rpc/health_check.py": "test_tls.py",  # `specdec health`, the TLS probes' check
    "specdec/engine/kv.py": "test_engine.py",
    "specdec/engine/model_files.py": "test_e2e_real.py",
    "specdec/engine/models.py": "test_kv_rollback.py",
    "specdec/sampling/probs.py": "test_sampling.py",  # the transform, draws and the sampling chi-square test
    "specdec/sampling/sampling_params.py": "test_sampling.py",
    "specdec/rpc/service_load.py": "test_load.py",  # the services' load reports
    "specdec/observability/telemetry.py": "test_observability.py",
    "specdec/engine/vocab.py": "test_structured_output.py",
    "specdec_app/__main__.py": "test_launcher.py",  # every service process runs `python -m specdec_app serve`
    "specdec_app/bench/arrivals.py": "test_bench_arrivals.py",
    "specdec_app/bench/ceiling.py": "test_bench_concurrency.py",
    "specdec_app/bench/chart.py": "test_bench_concurrency.py",
    "specdec_app/bench/dns_server.py": "test_discovery.py",  # the records a test changes while coordinators run
    "specdec_app/bench/conversation.py": "test_bench_conversation.py",
    "specdec_app/bench/cpu_pinning.py": "test_bench.py",  # --placement's pinnings and the pinned plain baseline
    "specdec_app/bench/cpu_time.py": "test_bench_cpu_time.py",
    "specdec_app/bench/load_generator.py": "test_bench_concurrency.py",
    "specdec_app/bench/load_methods.py": "test_bench_concurrency.py",
    "specdec_app/bench/measurement.py": "test_bench.py",
    "specdec_app/bench/network.py": "test_bench_network.py",
    "specdec_app/bench/pipeline_method.py": "test_bench_network.py",
    "specdec_app/bench/questions.py": "test_bench.py",
    "specdec_app/bench/report.py": "test_bench.py",
    "specdec_app/bench/run.py": "test_bench.py",
    "specdec_app/bench/structured.py": "test_bench_structured.py",
    "specdec_app/bench/transformers_methods.py": "test_bench.py",
    "specdec_app/cli.py": "test_bench.py",  # and every test_bench_*.py, test_supervision.py
    "specdec_app/local_ca.py": "test_tls.py",
    "verify_service/service.py": "test_load.py",  # a real verify service's calls and load reports
}


def modules() -> list[str]:
    """Our modules, as paths from the repository root (package __init__ files and generated protos left out)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py" and not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                found.append(path.relative_to(ROOT).as_posix())
    return found


def own_test(module: str) -> Path:
    return ROOT / "tests" / f"test_{Path(module).stem}.py"


def test_every_module_has_a_test_of_its_name_or_a_listed_one():
    missing = [m for m in modules() if not own_test(m).exists() and m not in COVERED_BY]
    assert not missing, f"add tests/test_<name>.py for these, or list them in COVERED_BY with their test: {missing}"


def test_the_list_names_real_tests_and_only_modules_that_need_it():
    stale = [m for m in COVERED_BY if m not in modules() or own_test(m).exists()]
    assert not stale, f"remove from COVERED_BY (gone, or now with a test of their own): {stale}"
    absent = {m: t for m, t in COVERED_BY.items() if not (ROOT / "tests" / t).exists()}
    assert not absent, f"COVERED_BY names test files that do not exist: {absent}"


MAX_ROUND_PATH_LINES = 500  # a file of the round's path (coordinator/speculation/) is read whole


def test_no_file_of_the_round_path_is_over_its_size():
    long = {}
    for path in sorted((ROOT / "coordinator" / "speculation").rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_ROUND_PATH_LINES:
            long[path.relative_to(ROOT).as_posix()] = lines
    assert not long, f"split these by concept (at most {MAX_ROUND_PATH_LINES} lines each): {long}"
