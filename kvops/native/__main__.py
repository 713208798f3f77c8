"""``python -m kvops.native``: build (or load the cached build of) the native CPU kernels now, e.g. in a Docker image
build step, so that the first CPU ``kvops.paged_attention`` of a program does not wait for the compiler."""

import sys

from . import available, build_directory


def main() -> int:
    if not available():
        print("kvops: the native CPU kernels are not available (see the warning above); the composite kernels run.")
        return 1
    print(f"kvops: native CPU kernels ready in {build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
