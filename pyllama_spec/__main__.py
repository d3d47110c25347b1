from pyllama_spec.cli import main

main()
