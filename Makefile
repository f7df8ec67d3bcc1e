# mbtunnel — the two commands: `make demo` and `make test`. Each installs what it needs first.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: deps build demo test lint bench speed clean

deps:
	@./scripts/deps.sh

build: deps
	$(CARGO) build --release --locked

demo: build
	./scripts/demo.sh

# Tests run in the release profile so BoringSSL is built once for build, demo and tests.
test: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --locked --all-targets -- -D warnings
	$(CARGO) test --release --locked --all-targets
	$(CARGO) build --release --locked
	./scripts/demo.sh

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --all-targets -- -D warnings

bench: deps
	$(CARGO) bench --bench mb

clean:
	$(CARGO) clean
