#!/bin/sh
# Submit `tv-ray verify` to a running Ray cluster as a Ray job and wait for it.
#   deployments/submit.sh http://HEAD:8265 --model llama3-8b --parallel dp=512 -o /shared/llama3-8b-dp512
#   deployments/submit.sh http://HEAD:8265 --resume /shared/llama3-8b-dp512      # a stopped job continues
# Everything after the address goes to `tv-ray verify`; -o must be a path every node can read back (a shared
# volume), since the job's driver writes the certificate on the node it runs on. Exit code: the job's.
set -eu
usage="usage: $0 http://HEAD:8265 VERIFY_ARGS... (tv-ray verify's: --model NAME --parallel SPEC -o OUT, or --resume OUT)"
case "${1-}" in
    -h|--help) echo "$usage"; exit 0 ;;
    ""|-*) echo "$usage" >&2; exit 2 ;;    # an address never starts with "-": it was left out
esac
address=$1
shift
cd "$(dirname "$0")/.."
ray job submit --address "$address" --working-dir . --runtime-env deployments/runtime_env.yaml -- tv-ray verify "$@"
