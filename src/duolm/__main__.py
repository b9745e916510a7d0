from duolm.cli import main

main()
