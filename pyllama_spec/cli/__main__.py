"""python -m pyllama_spec.cli"""

from pyllama_spec.cli import main

if __name__ == "__main__":
    main()
