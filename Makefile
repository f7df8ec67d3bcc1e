# mbtunnel — the two commands: `make demo` and `make test`. Each installs what it needs first.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: deps test-deps build demo test lint bench bench-dataplane bench-hsstorm speed clean image validate-deploy fuzz fuzz-smoke

deps:
	@./scripts/deps.sh

# What only the tests need: Debian's prometheus, which tests/dashboard.rs starts to run every query
# of deploy/grafana/mbtunnel-dashboard.json (never started as a service: deps.sh refuses starts),
# and python3 for tests/bench_tools.rs (the bench scripts' arithmetic in benches/lib).
test-deps: deps
	@./scripts/deps.sh --packages "prometheus python3" --label test-deps

build: deps
	$(CARGO) build --release --locked

demo: build
	./scripts/demo.sh

# Tests run in the release profile so BoringSSL is built once for build, demo and tests.
test: test-deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --locked --all-targets -- -D warnings
	$(CARGO) test --release --locked --all-targets
	$(CARGO) test --release --locked --lib --features ifma-count -- ifma_count
	$(CARGO) build --release --locked
	./scripts/demo.sh
	./scripts/validate-deploy.sh
	./scripts/fuzz.sh $(FUZZ_SMOKE_SECONDS)

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --all-targets -- -D warnings

bench: deps
	$(CARGO) bench --bench mb

# Data plane side by side with ztunnel (root: network namespaces; issue 14): prints the table and
# writes it to benches/README.md. Its tools (iperf3, wrk, hey, nginx) are installed here only.
# ROUNDS, SECS, BIN, ... as documented at the top of benches/dataplane.sh. It measures the `dist`
# binary (release + fat LTO), the one the image ships.
bench-dataplane:
	./scripts/bench-deps.sh
	$(CARGO) build --profile dist --locked --bin mbtunnel
	./benches/dataplane.sh

# Handshake-bound traffic between two nodes, N client identities in pods (root; issue 35):
# mbtunnel pair vs ztunnel pair, resumption on/off, P-256 and RSA-2048 workload keys. NS, ROUNDS,
# CONC, ... as documented at the top of benches/hsstorm.sh.
bench-hsstorm:
	./scripts/bench-deps.sh
	$(CARGO) build --profile dist --locked --bin mbtunnel
	./benches/hsstorm.sh

clean:
	$(CARGO) clean

# Container image (needs a Docker engine; none runs on our build machines).
IMAGE ?= mbtunnel:0.1.0
image:
	docker build --build-arg MBTUNNEL_GIT_REVISION=$$(git rev-parse HEAD 2>/dev/null || echo unknown) -t $(IMAGE) .

# deploy/ against the Kubernetes schemas (offline) and the binary; tests/deploy.rs checks ports,
# probes and the ConfigMap's config against the config parser.
validate-deploy: build
	./scripts/validate-deploy.sh
	$(CARGO) test --release --locked --test deploy

# Fuzz targets in fuzz/ (cargo-fuzz, built in fuzz/target): each runs FUZZ_SECONDS.
FUZZ_SECONDS ?= 60
fuzz: deps
	./scripts/fuzz.sh $(FUZZ_SECONDS)

# The same, a few seconds per target: proves they build and run.
FUZZ_SMOKE_SECONDS ?= 5
fuzz-smoke: deps
	./scripts/fuzz.sh $(FUZZ_SMOKE_SECONDS)
