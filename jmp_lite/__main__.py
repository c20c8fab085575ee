"""``python -m jmp_lite``: the comparison demo (see :mod:`jmp_lite.demo`)."""

from jmp_lite import demo

if __name__ == "__main__":
  demo.main()
