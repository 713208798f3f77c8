"""``python -m kvops.native [--isa native|x86-64-v3]``: build (or load the cached build of) the native CPU kernels now,
e.g. in a Docker image build step, so that the first CPU ``kvops.paged_attention`` of a program does not wait for the
compiler. ``--isa`` builds that variant (as ``KVOPS_NATIVE_ISA`` does, which it overrides; kvops/native/_variants.py)."""

import argparse
import os
import sys

from . import _variants, available, build_directory, isa, isa_macros


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvops.native", description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=list(_variants.VARIANTS),
                        help=f"the build variant (default: ${_variants.ENV}, else native)")
    args = parser.parse_args(argv)
    if args.isa:
        os.environ[_variants.ENV] = args.isa
    try:
        ok = available()
    except ValueError as e:  # a bad KVOPS_NATIVE_ISA, or x86-64-v3 on a machine that cannot run it
        print(f"kvops: {e}", file=sys.stderr)
        return 2
    if not ok:
        why = ("KVOPS_NATIVE=0 is set: unset it to build them" if os.environ.get("KVOPS_NATIVE", "1") == "0"
               else "see the warning above")
        print(f"kvops: the native CPU kernels are not available ({why}); the composite kernels run.")
        return 1
    macros = ", ".join(f"{m} {'defined' if on else 'undefined'}" for m, on in isa_macros().items())
    print(f"kvops: native CPU kernels ready in {build_directory()} ({isa()}: {macros})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
