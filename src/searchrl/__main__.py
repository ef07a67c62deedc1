from searchrl.cli import main

main()
